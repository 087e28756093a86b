"""The gateway's way into an engine's Tinker routes: the engine's admin token plus
``X-Loraplex-Namespace`` (server/tinker/keys.py AdminDelegation, server/middleware.py), beside
tenants' own ``--tinker-keys``, over real HTTP (uvicorn) with the protocol test's double.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from loraplex_engine.server.app import create_app
from loraplex_engine.server.tinker.keys import AdminDelegation

from tests.support.fake_engine import FakeEngine
from tests.support.tinker_double import FakeTraining
from tests.support.tinker_server import BASE, KEY_A, KEY_B, Server, tokenizer_dir

ADMIN = {"Authorization": "Bearer admin-token"}


def as_ns(ns: str) -> dict[str, str]:
    return {**ADMIN, "X-Loraplex-Namespace": ns}


def test_delegation_needs_the_exact_token_and_a_namespace_label() -> None:
    d = AdminDelegation("admin-token")
    assert d.namespace_for("Bearer admin-token", "team-a") == "team-a"
    assert d.namespace_for("bearer  admin-token ", "team-a") == "team-a"
    assert d.namespace_for("Bearer admin-token2", "team-a") is None
    assert d.namespace_for(None, "team-a") is None
    assert d.namespace_for("Bearer admin-token", "Team_A") is None
    assert d.namespace_for("Bearer admin-token", "a" * 64) is None
    assert d.namespace_for("Bearer admin-token", None) is None
    with pytest.raises(ValueError):
        AdminDelegation("")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path)
    yield s
    s.stop()


def test_the_admin_token_acts_for_the_namespace_it_names(server: Server) -> None:
    with httpx.Client(base_url=server.url + "/api/v1") as http:
        r = http.post("/create_session", json={}, headers=as_ns("team-a"))
        assert r.status_code == 200, r.text
        sid = r.json()["session_id"]
        beat = {"session_id": sid}
        assert http.post("/session_heartbeat", json=beat, headers=as_ns("team-a")).is_success
        # the namespace's own key sees it; another namespace, delegated or keyed, does not
        assert http.post("/session_heartbeat", json=beat, headers={"X-API-Key": KEY_A}).is_success
        r = http.post("/session_heartbeat", json=beat, headers=as_ns("team-b"))
        assert r.status_code == 404
        r = http.post("/session_heartbeat", json=beat, headers={"X-API-Key": KEY_B})
        assert r.status_code == 404


def test_only_the_admin_token_may_name_a_namespace(server: Server) -> None:
    with httpx.Client(base_url=server.url) as http:
        for headers in (
            {"X-API-Key": KEY_B, "X-Loraplex-Namespace": "team-a"},
            {"Authorization": "Bearer wrong", "X-Loraplex-Namespace": "team-a"},
            {"Authorization": f"Bearer {KEY_A}", "X-Loraplex-Namespace": "team-a"},
            {"X-Loraplex-Namespace": "team-a"},
        ):
            r = http.post("/api/v1/create_session", json={}, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            # refused before routing, on open paths too
            assert http.get("/healthz", headers=headers).status_code == 401
        r = http.post("/api/v1/create_session", json={}, headers=as_ns("Not_A_Label"))
        assert r.status_code == 401
        # the admin token alone is not a tenant: it must say for whom
        assert http.post("/api/v1/create_session", json={}, headers=ADMIN).status_code == 401


def test_an_engine_with_a_token_and_no_tenant_keys_serves_the_gateway(tmp_path: Path) -> None:
    training = FakeTraining(BASE, tokenizer_dir(tmp_path / "tok"), slots=1)
    app = create_app(FakeEngine(), "admin-token", training=lambda: training)
    from fastapi.testclient import TestClient

    try:
        with TestClient(app) as http:
            r = http.post("/api/v1/create_session", json={}, headers=as_ns("team-a"))
            assert r.status_code == 200, r.text
            r = http.post("/api/v1/create_session", json={}, headers={"X-API-Key": KEY_A})
            assert r.status_code == 401  # no --tinker-keys: no tenant key opens it
    finally:
        app.state.tinker.close()
    # without a token (--insecure-no-auth) and without keys, nothing is mounted
    bare = create_app(FakeEngine(), None, training=lambda: training)
    assert not hasattr(bare.state, "tinker")
