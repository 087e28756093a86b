"""The operator as the chart deploys it: the container `helm template` renders, run here.

`rendered_operator(values)` renders the chart (tests/chart/chart_helpers.render) and takes
the operator Deployment's container: its command, args, env, ports and probes, and the
metrics path of the chart's ServiceMonitor. `OperatorProcess` runs that container with
`pod_runtime` (the image's `kopf` is the virtualenv's; nothing else changes) and
points it at the test API server the way kopf and the operator's client find a cluster
outside one: `KUBECONFIG`. Health and metrics are probed where the chart's probes and
monitor look.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support import child_processes
from tests.support.chart_helpers import component, merge, operator_deployment, render
from tests.support.pod_runtime import container_env, local_command

OPERATOR_CONTAINER = "operator"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RenderedOperator:
    """The operator Pod of a `helm template` render, and where the chart probes it."""

    pod: dict[str, Any]  # the Deployment's Pod template, with the metadata a Pod would get
    container: dict[str, Any]
    metrics_path: str
    metrics_port: str  # the ServiceMonitor endpoint's port (a container port name)

    def port(self, name_or_number: str | int) -> int:
        for port in self.container.get("ports") or []:
            if name_or_number in (port.get("name"), port["containerPort"]):
                return int(port["containerPort"])
        raise AssertionError(f"operator container declares no port {name_or_number!r}")

    def probe_url(self, probe: str) -> str:
        """`livenessProbe` / `readinessProbe` as a URL on loopback."""
        get = self.container[probe]["httpGet"]
        return f"http://127.0.0.1:{self.port(get['port'])}{get['path']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.port(self.metrics_port)}{self.metrics_path}"


def rendered_operator(values: dict[str, Any]) -> RenderedOperator:
    deployment = operator_deployment(render(values))
    template = deployment["spec"]["template"]
    pod = {
        "metadata": {
            **template["metadata"],
            "name": f"{deployment['metadata']['name']}-0",
            "namespace": deployment["metadata"]["namespace"],
        },
        "spec": template["spec"],
    }
    container = next(c for c in pod["spec"]["containers"] if c["name"] == OPERATOR_CONTAINER)
    # The path Prometheus scrapes: the chart's ServiceMonitor for the same values.
    monitored = merge(values, {"monitoring": {"serviceMonitor": {"enabled": True}}})
    [monitor] = component(render(monitored), "ServiceMonitor", "operator")
    endpoint = monitor["spec"]["endpoints"][0]
    return RenderedOperator(pod, container, endpoint.get("path", "/metrics"), endpoint["port"])


@dataclass
class OperatorProcess:
    """The rendered operator container as a process (restartable, like a Pod's)."""

    rendered: RenderedOperator
    kubeconfig: Path
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    argv: list[str] = field(default_factory=list)

    def start(self) -> None:
        self.starts += 1
        self.argv = local_command(self.rendered.container, {}, free_ports=False)
        env = container_env(self.rendered.pod, self.rendered.container)
        env["KUBECONFIG"] = str(self.kubeconfig)  # outside a cluster kopf reads this
        with open(self.workdir / f"operator-{self.starts}.log", "wb") as log:
            self.proc = child_processes.spawn(
                self.argv,
                f"operator {self.workdir}",
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=str(self.workdir),
            )

    def kill(self) -> None:
        if self.proc is not None:
            child_processes.kill_group(self.proc)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, as the kubelet does; SIGKILL to what is left after `timeout`."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.kill()

    def log_text(self) -> str:
        return "".join(
            (self.workdir / f"operator-{i}.log").read_text(errors="replace")
            for i in range(1, self.starts + 1)
        )

    @property
    def metrics_url(self) -> str:
        """Where the chart's ServiceMonitor scrapes (port and path)."""
        return self.rendered.metrics_url

    @property
    def metrics_port(self) -> int:
        return self.rendered.port(self.rendered.metrics_port)

    @property
    def health_url(self) -> str:
        return self.rendered.probe_url("readinessProbe")


def chart_values(base: dict[str, Any] | None, tuning: dict[str, str] | None) -> dict[str, Any]:
    """`base` values with the two ports free on this machine (the defaults, 8080 and 8081,
    may be taken by another test) and `tuning` as the operator's extraEnv."""
    ports = {"operator": {"ports": {"metrics": free_port(), "health": free_port()}}}
    extra = {"operator": {"extraEnv": [{"name": k, "value": v} for k, v in (tuning or {}).items()]}}
    return merge(base or {}, ports, extra if tuning else {})
