"""A real Prometheus server on 127.0.0.1 for tests, scraping like the chart's monitors.

`PrometheusServer` runs `.tools/bin/prometheus` (`make tools`) with a generated config,
a temporary TSDB and a free loopback port; start-up and targets are awaited on
conditions (`/-/ready`, `/api/v1/targets`), never fixed sleeps.

Targets come from file-based service discovery (`file_sd_configs`): the test writes one
JSON file per job with the `__meta_kubernetes_*` labels Kubernetes service discovery
would attach, and the scrape config is translated from the chart's rendered PodMonitor
and ServiceMonitor the way the Prometheus Operator does it (keep rules from the
selectors and the port name, the standard `namespace`/`pod`/`container`/`endpoint`/
`service`/`job` labels, then the monitor's own relabelings and honorLabels). So the
series in this Prometheus carry exactly the labels dashboards and alerts see in a
cluster, and a selector that no longer matches the operator's engine pods drops them.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sanitize(name: str) -> str:
    """Kubernetes SD's label-name mangling: every invalid character becomes `_`."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


# --- monitors → scrape configs (what the Prometheus Operator generates) -------------------


def _user_relabelings(relabelings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = {
        "sourceLabels": "source_labels",
        "targetLabel": "target_label",
        "separator": "separator",
        "regex": "regex",
        "replacement": "replacement",
        "action": "action",
        "modulus": "modulus",
    }
    out = []
    for r in relabelings:
        rule = {keys[k]: v for k, v in r.items() if k in keys}
        if "action" in rule:
            rule["action"] = rule["action"].lower()
        out.append(rule)
    return out


def _selector_keeps(selector: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """keep rules for a label selector over `__meta_kubernetes_<prefix>_label*`."""
    rules: list[dict[str, Any]] = []
    for key, value in sorted((selector.get("matchLabels") or {}).items()):
        rules.append(
            {
                "action": "keep",
                "source_labels": [
                    f"__meta_kubernetes_{prefix}_label_{_sanitize(key)}",
                    f"__meta_kubernetes_{prefix}_labelpresent_{_sanitize(key)}",
                ],
                "regex": f"({re.escape(value)});true",
            }
        )
    for expr in selector.get("matchExpressions") or []:
        key, op = _sanitize(expr["key"]), expr["operator"]
        if op == "Exists":
            rules.append(
                {
                    "action": "keep",
                    "source_labels": [f"__meta_kubernetes_{prefix}_labelpresent_{key}"],
                    "regex": "true",
                }
            )
        elif op == "In":
            values = "|".join(re.escape(v) for v in expr["values"])
            rules.append(
                {
                    "action": "keep",
                    "source_labels": [f"__meta_kubernetes_{prefix}_label_{key}"],
                    "regex": f"({values})",
                }
            )
        else:
            raise NotImplementedError(f"selector operator {op}")
    return rules


def _namespace_keep(monitor: dict[str, Any]) -> dict[str, Any]:
    """Keep targets in the monitor's namespaceSelector (both monitor kinds)."""
    return {
        "action": "keep",
        "source_labels": ["__meta_kubernetes_namespace"],
        "regex": "|".join(monitor["spec"]["namespaceSelector"]["matchNames"]),
    }


def _scrape_job(
    name: str,
    endpoint: dict[str, Any],
    sd_file: Path,
    interval: str,
    relabel: list[dict[str, Any]],
) -> dict[str, Any]:
    """The scrape job both monitor kinds become, around their own relabelling."""
    return {
        "job_name": name,
        "honor_labels": bool(endpoint.get("honorLabels", False)),
        "metrics_path": endpoint.get("path", "/metrics"),
        "scrape_interval": interval,
        "scrape_timeout": interval,
        "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": "1s"}],
        "relabel_configs": relabel,
    }


def pod_monitor_scrape_config(
    monitor: dict[str, Any], sd_file: Path, interval: str, credentials_file: Path | None = None
) -> dict[str, Any]:
    """``credentials_file``: where the test put the value of the Secret the endpoint's
    ``authorization`` names (the Prometheus Operator reads it from the Secret)."""
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    meta = monitor["metadata"]
    relabel: list[dict[str, Any]] = [
        *_selector_keeps(monitor["spec"]["selector"], "pod"),
        _namespace_keep(monitor),
        {
            "action": "keep",
            "source_labels": ["__meta_kubernetes_pod_container_port_name"],
            "regex": endpoint["port"],
        },
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"},
        {"target_label": "endpoint", "replacement": endpoint["port"]},
        *_user_relabelings(endpoint.get("relabelings") or []),
    ]
    job = _scrape_job(
        f"podMonitor/{meta['namespace']}/{meta['name']}/0", endpoint, sd_file, interval, relabel
    )
    auth = endpoint.get("authorization")
    if auth is not None:
        assert credentials_file is not None, "the monitor scrapes with a Secret's token"
        job["authorization"] = {"type": auth["type"], "credentials_file": str(credentials_file)}
    return job


def service_monitor_scrape_config(
    monitor: dict[str, Any], sd_file: Path, interval: str
) -> dict[str, Any]:
    (endpoint,) = monitor["spec"]["endpoints"]
    meta = monitor["metadata"]
    relabel: list[dict[str, Any]] = [
        *_selector_keeps(monitor["spec"]["selector"], "service"),
        _namespace_keep(monitor),
        {
            "action": "keep",
            "source_labels": ["__meta_kubernetes_endpoint_port_name"],
            "regex": endpoint["port"],
        },
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"},
        {"target_label": "endpoint", "replacement": endpoint["port"]},
        *_user_relabelings(endpoint.get("relabelings") or []),
    ]
    return _scrape_job(
        f"serviceMonitor/{meta['namespace']}/{meta['name']}/0", endpoint, sd_file, interval, relabel
    )


# --- discovery metadata, as Kubernetes service discovery attaches it -----------------------


def _label_meta(prefix: str, labels: dict[str, str]) -> dict[str, str]:
    out = {}
    for key, value in labels.items():
        out[f"__meta_kubernetes_{prefix}_label_{_sanitize(key)}"] = value
        out[f"__meta_kubernetes_{prefix}_labelpresent_{_sanitize(key)}"] = "true"
    return out


def pod_targets(pod: dict[str, Any], address: str) -> list[dict[str, Any]]:
    """Role `pod` targets of a Pod: one per declared container port. `address` replaces
    `podIP:containerPort` (here every engine listens on its own loopback port)."""
    meta = pod["metadata"]
    out = []
    for container in pod["spec"]["containers"]:
        for port in container.get("ports") or []:
            labels = {
                "__meta_kubernetes_namespace": meta["namespace"],
                "__meta_kubernetes_pod_name": meta["name"],
                "__meta_kubernetes_pod_container_name": container["name"],
                "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                **_label_meta("pod", meta.get("labels") or {}),
            }
            out.append({"targets": [address], "labels": labels})
    return out


def endpoint_targets(
    service: dict[str, Any], pod_name: str, container: str, address: str
) -> list[dict[str, Any]]:
    """Role `endpoints` targets of a Service backed by one pod."""
    meta = service["metadata"]
    out = []
    for port in service["spec"]["ports"]:
        labels = {
            "__meta_kubernetes_namespace": meta["namespace"],
            "__meta_kubernetes_service_name": meta["name"],
            "__meta_kubernetes_endpoint_port_name": port.get("name", ""),
            "__meta_kubernetes_pod_name": pod_name,
            "__meta_kubernetes_pod_container_name": container,
            **_label_meta("service", meta.get("labels") or {}),
        }
        out.append({"targets": [address], "labels": labels})
    return out


def write_sd_file(path: Path, groups: list[dict[str, Any]]) -> None:
    """Atomically replace a file_sd file (Prometheus re-reads it on change)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups, indent=1, sort_keys=True))
    os.replace(tmp, path)


class QueryError(AssertionError):
    """Prometheus answered an API call with an error."""


# --- the server -------------------------------------------------------------------------------


class PrometheusServer:
    def __init__(
        self,
        binary: Path,
        workdir: Path,
        scrape_configs: list[dict[str, Any]],
        rule_files: list[Path] | None = None,
    ) -> None:
        self.binary = binary
        self.workdir = workdir
        self.scrape_configs = scrape_configs
        self.rule_files = list(rule_files or [])
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.url = ""
        self.started_at = 0.0  # wall clock, seconds

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    def start(self, timeout: float = 60.0) -> PrometheusServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(f) for f in self.rule_files],
                    "scrape_configs": self.scrape_configs,
                },
                sort_keys=False,
            )
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log = self.log_path.open("wb")
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            [
                str(self.binary),
                f"--config.file={config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1d",
                "--log.level=info",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=str(self.workdir),
        )
        log.close()
        try:
            self.wait_for("/-/ready", self._ready, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])
        except OSError:
            return ""

    # --- HTTP API ---

    def api(self, path: str, **params: str) -> Any:
        """GET an API path; a PromQL error raises QueryError with Prometheus's message."""
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # 400/422/503 carry a JSON error body
            try:
                body = json.load(e)
            except ValueError:
                raise QueryError(f"{path} {params}: HTTP {e.code}") from e
        if body.get("status") != "success":
            raise QueryError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("/api/v1/query", **params)
        result = data["result"]
        return result if data["resultType"] == "vector" else [{"metric": {}, "value": result}]

    def rules(self) -> list[dict[str, Any]]:
        return [r for g in self.api("/api/v1/rules")["groups"] for r in g["rules"]]

    def active_targets(self) -> list[dict[str, Any]]:
        return self.api("/api/v1/targets", state="active")["activeTargets"]

    def up_targets(self, job: str) -> list[dict[str, Any]]:
        return [
            t
            for t in self.active_targets()
            if t["labels"].get("job") == job and t["health"] == "up"
        ]

    def wait_for(
        self,
        what: str,
        condition: Callable[[], Any],
        timeout: float = 60.0,
        interval: float = 0.25,
    ) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited:\n{self.log_tail()}")
            try:
                last = condition()
            except OSError as e:  # not listening yet
                last = e
            if last and not isinstance(last, Exception):
                return last
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out waiting for {what} (last: {last!r})\n{self.log_tail()}"
                )
            time.sleep(interval)
