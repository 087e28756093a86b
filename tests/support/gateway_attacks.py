"""Path attacks on the gateway from a tenant's key: raw request targets written on the
socket as given (no client normalises a dot segment away), the Tinker and OpenAI paths
that try to climb to an engine's admin API, the gateway's own refusal, and the engine
paths the gateway may forward (read back from the engine's access log)."""

from __future__ import annotations

import json
import re
import socket
from urllib.parse import urlsplit

from tests.support.server_process import EngineServer

KEY_A_RO = "tml-team-a-sample-0123456789"
KEY_B = "tml-team-b-train-0123456789"
SECRET = "team-b.secret"
# The engine paths the gateway may send (its allowlist, as the engine logs them).
FORWARDED = re.compile(
    r"^(/api/v1/[a-z_]+(/[A-Za-z0-9_][A-Za-z0-9._:~@-]*(/(finish|checkpoints))?)?"
    r"|/v1/models(/[A-Za-z0-9_][A-Za-z0-9._:@-]*)?|/v1/capacity|/v1/(chat/)?completions)$"
)


def send_raw(url: str, method: str, target: bytes, headers: dict[str, str], body: bytes = b""):
    """One request with ``target`` written as given (no client normalises it): the status
    and the body."""
    parts = urlsplit(url)
    lines = [method.encode() + b" " + target + b" HTTP/1.1", f"Host: {parts.netloc}".encode()]
    lines += [f"{k}: {v}".encode() for k, v in headers.items()]
    lines += [f"Content-Length: {len(body)}".encode(), b"Connection: close", b"", b""]
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as s:
        s.sendall(b"\r\n".join(lines) + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), payload


def engine_requests(engine: EngineServer, since: int) -> list[tuple[str, str, str]]:
    """(method, path, status) of the engine's access lines after the first ``since``
    characters of its log."""
    found = re.findall(r"\b(GET|POST|PUT|DELETE) (/\S*) (\d{3}) ", engine.log_text()[since:])
    return [(m, p, s) for m, p, s in found]


def tinker_attacks(sid: str) -> list[tuple[str, str]]:
    up = "/../../../.."
    enc = "/%2e%2e/%2e%2e/%2e%2e/%2e%2e"
    return [
        ("GET", f"/api/v1/sessions/{sid}{up}/v1/experiments"),
        ("GET", f"/api/v1/sessions/{sid}{enc}/v1/experiments"),
        ("GET", f"/api/v1/sessions/{sid}{enc.upper()}/v1/experiments"),
        ("GET", f"/api/v1/sessions/{sid}%2f..%2f..%2f..%2f..%2fv1%2fexperiments"),
        ("GET", f"/api/v1/sessions/{sid}//..{up}/v1/experiments"),
        ("GET", f"/api/v1/sessions/{sid}/./{up}/v1/experiments"),
        ("GET", f"/api/v1/training_runs/{sid}/../../../v1/experiments"),
        ("GET", f"/api/v1/samplers/{sid}/../../../v1/experiments"),
        ("POST", f"/api/v1/sessions/{sid}/finish/../../../../../v1/experiments"),
        ("POST", f"/api/v1/sessions/{sid}{up}/v1/experiments/{SECRET}/checkpoint"),
        ("POST", f"/api/v1/sessions/{sid}{enc}/v1/experiments/{SECRET}/versions"),
        ("POST", f"/api/v1/sessions/{sid}{up}/v1/completions"),
        ("GET", "/api/v1/../../v1/experiments"),
        ("GET", "/api/v1/samplers/.."),
        ("GET", "/api/v1/samplers/%0a"),
        ("GET", "/api/v1/samplers/a%0d%0aX-Loraplex-Namespace:%20team-b"),
        ("GET", "/api/v1/v1/experiments"),
        ("GET", "/api/v1/sessions/" + sid),
    ]


OPENAI_ATTACKS = [
    ("GET", "/v1/models/team-a./../../../v1/experiments"),
    ("GET", "/v1/models/team-a.%2e%2e/%2e%2e/%2e%2e/v1/experiments"),
    ("GET", "/v1/models/team-a.%2E%2E%2f%2E%2E%2fexperiments"),
    ("GET", "/v1/models/..%2f..%2fv1%2fexperiments"),
    ("GET", "/v1/models//../../v1/experiments"),
    ("GET", "/v1/models/%0a"),
    ("GET", "/v1/./experiments"),
    ("GET", "/v1/experiments"),
    ("POST", f"/v1/experiments/{SECRET}/checkpoint"),
]


def refusal(status: int, body: bytes) -> bool:
    """The gateway's own 4xx: its error body (or Starlette's bare 404 for no route)."""
    if not 400 <= status < 500 or status == 401:
        return False
    return body == b"Not Found" or bool(json.loads(body).get("error", {}).get("message"))
