"""A tenant's key never reaches an engine's admin API through the gateway: a real
``loraplex-engine serve`` process behind a real gateway process (``python -m
loraplex_operator.gateway``, as the chart runs it, with ``--engines-file``).

Team-a's sample key sends raw request targets (written on the socket as they are, so no
client removes a dot segment first): ``..`` after a session id, ``%2e%2e``, ``%2E%2E``,
``%2f``, empty segments, control characters, on Tinker and OpenAI paths, and OpenAI
model ids that are paths. Each is answered 4xx by the gateway with an error body, and
the engine's access log shows no request outside the routes the gateway forwards (no
listing of team-b's experiments, no checkpoint forced, no version published). The
engine itself refuses the admin token on its admin API when it carries a tenant's
``X-Loraplex-Namespace`` (defence in depth). A key file edit with one bad entry still
revokes the key it removed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_attacks import (
    FORWARDED,
    KEY_A_RO,
    KEY_B,
    OPENAI_ATTACKS,
    SECRET,
    engine_requests,
    refusal,
    send_raw,
    tinker_attacks,
)
from tests.support.gateway_process import GatewayProcess
from tests.support.server_process import EngineServer, wait_until
from tests.support.server_specs import put_body, small_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    work = tmp_path_factory.mktemp("gw-paths-engine")
    with EngineServer(tiny_model_dir, work / "ckpt", max_adapters=2, workdir=work) as srv:
        with srv.client() as api:
            r = api.put(f"/v1/experiments/{SECRET}", json=put_body(SECRET, small_spec()))
            assert r.status_code == 201, r.text
        yield srv


@pytest.fixture(scope="module")
def gateway(engine: EngineServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    view = {
        "engines": [{"name": "e1", "pool": "pool", "url": engine.url, "token": engine.token}],
        "keys": [
            {"namespace": "team-a", "key": KEY_A_RO, "role": "sample"},
            {"namespace": "team-b", "key": KEY_B, "role": "train"},
        ],
    }
    gw = GatewayProcess(tmp_path_factory.mktemp("gw-paths"), view)
    gw.start()
    try:
        yield gw.url
    finally:
        gw.stop()


BODY_MODELS = [
    "team-a./../../../v1/experiments",
    f"../../v1/experiments/{SECRET}",
    "say\nyes",
    "say\r\nX-Loraplex-Namespace: team-b",
    "team-a.%2e%2e",
]


A_HEADERS = {"X-API-Key": KEY_A_RO, "Content-Type": "application/json"}


def assert_not_reached(engine: EngineServer, since: int) -> None:
    reached = [(m, p, s) for m, p, s in engine_requests(engine, since) if not FORWARDED.match(p)]
    assert reached == [], f"the engine was called outside the gateway's routes: {reached}"


def test_tinker_paths_never_reach_the_admin_api(gateway: str, engine: EngineServer) -> None:
    since = len(engine.log_text())
    r = httpx.post(f"{gateway}/api/v1/create_session", json={}, headers=A_HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    sid = r.json()["session_id"]
    # the access log shows what reached the engine (here, the session's creation)
    wait_until(lambda: ("POST", "/api/v1/create_session", "200") in engine_requests(engine, since))
    for method, target in tinker_attacks(sid):
        status, body = send_raw(gateway, method, target.encode(), A_HEADERS, b"{}")
        assert refusal(status, body), (method, target, status, body)
    assert_not_reached(engine, since)


def test_openai_paths_never_reach_the_admin_api(gateway: str, engine: EngineServer) -> None:
    since = len(engine.log_text())
    for method, target in OPENAI_ATTACKS:
        status, body = send_raw(gateway, method, target.encode(), A_HEADERS, b"{}")
        assert refusal(status, body), (method, target, status, body)
    assert_not_reached(engine, since)


def test_a_model_id_that_is_a_path_or_holds_a_newline_is_a_400(
    gateway: str, engine: EngineServer
) -> None:
    since = len(engine.log_text())
    for route in (b"/v1/completions", b"/v1/chat/completions"):
        for model in BODY_MODELS:
            doc = {"model": model, "prompt": "a", "max_tokens": 2}
            status, body = send_raw(gateway, "POST", route, A_HEADERS, json.dumps(doc).encode())
            assert status == 400, (route, model, status, body)  # never a 500, never sent
            error = json.loads(body)["error"]
            assert error["field"] == "model" and "not a model id" in error["message"], body
    assert_not_reached(engine, since)


def test_the_allowed_routes_still_pass(gateway: str, engine: EngineServer) -> None:
    a = {"X-API-Key": KEY_A_RO}
    with httpx.Client(base_url=gateway, headers=a, timeout=60) as http:
        sid = http.post("/api/v1/create_session", json={}).json()["session_id"]
        assert http.post("/api/v1/session_heartbeat", json={"session_id": sid}).status_code == 200
        assert http.get("/api/v1/training_runs").status_code == 200
        assert http.get("/api/v1/get_server_capabilities").status_code == 200
        assert http.post(f"/api/v1/sessions/{sid}/finish", json={}).status_code == 200
        r = http.get("/v1/models/secret")
        assert r.status_code == 404, r.text  # team-b's, not team-a's
    b = {"Authorization": f"Bearer {KEY_B}"}
    r = httpx.get(f"{gateway}/v1/models/secret", headers=b, timeout=60)
    assert r.status_code == 200 and r.json()["id"] == SECRET, r.text


def test_the_engine_refuses_a_tenants_request_outside_the_tenant_routes(
    engine: EngineServer,
) -> None:
    admin = {"Authorization": f"Bearer {engine.token}"}
    tenant = {**admin, "X-Loraplex-Namespace": "team-a"}
    with httpx.Client(base_url=engine.url, timeout=60) as http:
        assert http.get("/v1/experiments", headers=admin).status_code == 200
        for method, path in (
            ("GET", "/v1/experiments"),
            ("GET", f"/v1/experiments/{SECRET}"),
            ("POST", f"/v1/experiments/{SECRET}/checkpoint"),
            ("POST", f"/v1/experiments/{SECRET}/versions"),
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
        ):
            r = http.request(method, path, headers=tenant, json={})
            assert r.status_code == 403, (path, r.text)
            assert r.json()["error"]["field"] == "X-Loraplex-Namespace"
        assert http.get("/api/v1/training_runs", headers=tenant).status_code == 200
    status, body = send_raw(engine.url, "GET", b"/api/v1/../../v1/experiments", tenant)
    assert status == 403, body
    status, body = send_raw(engine.url, "GET", b"/api/v1/%2e%2e/%2e%2e/v1/experiments", tenant)
    assert status == 403, body


def test_a_bad_key_entry_does_not_keep_a_revoked_key(tmp_path: Path) -> None:
    keep, gone = "tml-team-a-kept-0123456789", "tml-team-a-gone-0123456789"
    keys = [{"namespace": "team-a", "key": k, "role": "sample"} for k in (keep, gone)]
    gw = GatewayProcess(tmp_path, {"engines": [], "keys": keys})
    gw.start()
    try:

        def status(key: str) -> int:
            return httpx.get(f"{gw.url}/v1/models", headers={"X-API-Key": key}).status_code

        assert status(keep) == 200 and status(gone) == 200
        # one edit removes a key and adds an entry that is no key entry at all
        gw.write({"engines": [], "keys": [keys[0], "tml-pasted-bare-0123456789"]})
        wait_until(lambda: status(gone) == 401, timeout=30)
        assert status(keep) == 200
        assert "API key not loaded" in gw.log()
    finally:
        gw.stop()
