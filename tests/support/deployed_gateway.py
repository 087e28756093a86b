"""The gateway as the chart deploys it: the container `helm template` renders (with
`gateway.enabled`), run here against the test API server, as deployed.py runs the
operator's. Its command is the image's `python -m loraplex_operator.gateway` (the
virtualenv's python), its args and env the chart's; it finds the cluster the way a
client outside one does (`KUBECONFIG`), and listens on the chart's port (a free one)."""

from __future__ import annotations

import contextlib
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support import child_processes
from tests.support.chart_helpers import merge, render
from tests.support.deployed import free_port
from tests.support.pod_runtime import container_env, local_command

GATEWAY_CONTAINER = "gateway"


def gateway_values(base: dict[str, Any] | None = None) -> dict[str, Any]:
    """`base` with the gateway on, at a free port, refreshing its view every second."""
    return merge(
        base or {}, {"gateway": {"enabled": True, "port": free_port(), "refreshSeconds": 1}}
    )


def rendered_gateway(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the gateway Deployment's Pod, its gateway container) as `helm template` renders."""
    deployments = [d for d in render(values) if d.get("kind") == "Deployment"]
    deployment = next(d for d in deployments if "gateway" in d["metadata"]["name"])
    template = deployment["spec"]["template"]
    pod = {
        "metadata": {
            **template["metadata"],
            "name": f"{deployment['metadata']['name']}-0",
            "namespace": deployment["metadata"]["namespace"],
        },
        "spec": template["spec"],
    }
    container = next(c for c in pod["spec"]["containers"] if c["name"] == GATEWAY_CONTAINER)
    return pod, container


@dataclass
class GatewayContainer:
    pod: dict[str, Any]
    container: dict[str, Any]
    kubeconfig: Path
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    argv: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.container['ports'][0]['containerPort']}"

    def start(self, ready_timeout: float = 60.0) -> None:
        self.argv = local_command(self.container, {}, free_ports=False)
        env = container_env(self.pod, self.container)
        env["KUBECONFIG"] = str(self.kubeconfig)
        with open(self.workdir / "gateway.log", "wb") as log:
            self.proc = child_processes.spawn(
                self.argv,
                f"gateway {self.workdir}",
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=str(self.workdir),
            )
        deadline = time.monotonic() + ready_timeout
        while True:
            with contextlib.suppress(httpx.TransportError):
                r = httpx.get(self.url + "/readyz", timeout=2)
                if r.status_code == 200 and r.json().get("engines"):
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway not ready:\n{self.log_text()[-4000:]}")
            time.sleep(0.2)

    def log_text(self) -> str:
        return (self.workdir / "gateway.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None:
            child_processes.kill_group(self.proc)
