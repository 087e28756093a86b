"""The `helm test` hook: a Pod that checks the operator's /healthz and every engine's
/readyz, at the Services and ports the chart renders, allowed by the NetworkPolicy."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from tests.support.chart_helpers import (
    ALL_ON,
    NAMESPACE,
    SCENARIOS,
    by_kind,
    merge,
    one,
    operator_deployment,
    render,
)

FULL = "loraplex"


def _hook(docs: list[dict]) -> dict:
    pods = [
        p for p in by_kind(docs, "Pod") if p["metadata"]["annotations"]["helm.sh/hook"] == "test"
    ]
    assert len(pods) == 1, pods
    return pods[0]


def _env(pod: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}


def _service_url(docs: list[dict], name: str, port_name: str, namespace: str) -> tuple[str, int]:
    svc = one(docs, "Service", name)
    assert svc["metadata"]["namespace"] == namespace
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == port_name)
    return f"{name}.{namespace}.svc", port


@pytest.mark.parametrize("scenario", ["default", "namespaced", "engines-elsewhere"])
def test_hook_checks_the_rendered_operator_service_and_engines(scenario: str) -> None:
    docs = render(SCENARIOS[scenario])
    pod = _hook(docs)
    env = _env(pod)
    host, port = _service_url(docs, f"{FULL}-operator-metrics", "metrics", NAMESPACE)
    assert env["OPERATOR_HEALTH_URL"] == f"http://{host}:{port}/healthz"
    engines = one(docs, "Service", f"{FULL}-engines")
    host, port = _service_url(docs, f"{FULL}-engines", "http", engines["metadata"]["namespace"])
    assert engines["spec"]["clusterIP"] == "None"  # one address per engine pod
    assert (env["ENGINES_HOST"], env["ENGINES_PORT"]) == (host, str(port))
    # the engine pods' readiness probe path (operator manifests.py) is what the hook asks for
    assert "/readyz" in pod["spec"]["containers"][0]["args"][0]
    assert pod["spec"]["restartPolicy"] == "Never"
    deployment = operator_deployment(docs)["spec"]["template"]["spec"]
    assert pod["spec"]["containers"][0]["image"] == deployment["containers"][0]["image"]
    assert pod["spec"]["securityContext"] == deployment["securityContext"]


def test_hook_passes_against_a_healthy_operator_with_no_engines_expected() -> None:
    """The script itself, with the operator answering 200 and the default pool keeping
    no engines: it succeeds (the failing case is the test below)."""

    class Healthy(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pod = _hook(render())
        health = f"http://127.0.0.1:{server.server_port}/healthz"
        env = {**_env(pod), "OPERATOR_HEALTH_URL": health, "ENGINES_HOST": ""}
        script = pod["spec"]["containers"][0]["args"][0]
        proc = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hook_fails_without_engines_only_when_the_default_pool_keeps_some() -> None:
    assert _env(_hook(render()))["ENGINES_EXPECTED"] == "0"
    kept = {"defaultPool": {"enabled": True, "spec": {"replicas": {"min": 2, "max": 2}}}}
    assert _env(_hook(render(kept)))["ENGINES_EXPECTED"] == "2"


def test_hook_runs_and_reports_a_missing_operator() -> None:
    """The script itself, with the operator unreachable and no Services: it fails."""
    pod = _hook(render())
    env = {**_env(pod), "OPERATOR_HEALTH_URL": "http://127.0.0.1:9/healthz", "ENGINES_HOST": ""}
    script = pod["spec"]["containers"][0]["args"][0]
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1 and "operator http://127.0.0.1:9/healthz" in proc.stdout


def test_network_policy_lets_the_hook_reach_the_engines() -> None:
    docs = render(ALL_ON)
    pod = _hook(docs)
    policy = one(docs, "NetworkPolicy")
    labels = pod["metadata"]["labels"]
    peers = [p for rule in policy["spec"]["ingress"] for p in rule["from"]]
    assert any(
        p["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": NAMESPACE}
        and p["podSelector"]["matchLabels"].items() <= labels.items()
        and p["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == "helm-test"
        for p in peers
    )


def test_hook_can_be_turned_off() -> None:
    docs = render(merge(ALL_ON, {"tests": {"enabled": False}}))
    assert not by_kind(docs, "Pod")
    peers = [p for rule in one(docs, "NetworkPolicy")["spec"]["ingress"] for p in rule["from"]]
    assert not any(
        p["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == "helm-test"
        for p in peers
    )
