"""The generated engine token survives upgrades: `lookup` finds the stored Secret.

`helm template --dry-run=server` runs the chart's `lookup` calls against the cluster in
KUBECONFIG; here that is a tiny fake API server on 127.0.0.1 that knows one Secret.
"""

from __future__ import annotations

import base64
import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from chart_helpers import CHART, NAMESPACE, RELEASE, tool

SECRET = "loraplex-engine-token"
STORED = "stored-token-from-the-first-install-0123456789ab"


class FakeApi(BaseHTTPRequestHandler):
    secret_data: dict[str, str] | None = None

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/api/v1":
            body = {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
                {"name": "secrets", "singularName": "secret", "namespaced": True,
                 "kind": "Secret", "verbs": ["get", "list"]}]}  # fmt: skip
        elif path == f"/api/v1/namespaces/{NAMESPACE}/secrets/{SECRET}" and self.secret_data:
            body = {"kind": "Secret", "apiVersion": "v1", "data": self.secret_data,
                    "metadata": {"name": SECRET, "namespace": NAMESPACE}}  # fmt: skip
        else:
            self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                             "reason": "NotFound", "code": 404})  # fmt: skip
            return
        self._send(200, body)

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_cluster(tmp_path: Path) -> Iterator[Path]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {
                "server": f"http://127.0.0.1:{server.server_address[1]}"}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        })
    )  # fmt: skip
    try:
        yield kubeconfig
    finally:
        server.shutdown()
        FakeApi.secret_data = None


def _token(kubeconfig: Path) -> str:
    cmd = [str(tool("helm")), "template", RELEASE, str(CHART), "-n", NAMESPACE]
    cmd += ["--dry-run=server", "--show-only", "templates/engine-token-secret.yaml"]
    env = {"KUBECONFIG": str(kubeconfig), "HOME": str(kubeconfig.parent), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return base64.b64decode(yaml.safe_load(proc.stdout)["data"]["token"]).decode()


def test_upgrade_keeps_the_stored_token(fake_cluster: Path) -> None:
    FakeApi.secret_data = {"token": base64.b64encode(STORED.encode()).decode()}
    assert _token(fake_cluster) == STORED


def test_first_install_generates_a_token(fake_cluster: Path) -> None:
    first, second = _token(fake_cluster), _token(fake_cluster)
    assert len(first) == 48 and first.isalnum()
    assert first != second  # nothing stored yet: each render draws a new one


def test_stored_secret_without_the_key_gets_a_new_token(fake_cluster: Path) -> None:
    FakeApi.secret_data = {"other": base64.b64encode(b"x").decode()}
    token = _token(fake_cluster)
    assert token != STORED and len(token) == 48
