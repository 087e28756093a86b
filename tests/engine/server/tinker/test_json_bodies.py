"""Big JSON bodies on the Tinker routes are parsed on a decode thread, not the event loop
(server/tinker/json_bodies.py); small ones stay on the loop. In-process app: the thread a
parse runs on is what is checked, no engine needed."""

from __future__ import annotations

import threading

import anyio
import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient
from loraplex_engine.server.tinker import json_bodies
from pydantic import BaseModel


class Tokens(BaseModel):
    tokens: list[int]


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The thread of every off-loop parse."""
    seen: list[int] = []
    real = json_bodies.parse_json

    def recording(body: bytes) -> object:
        seen.append(threading.get_ident())
        return real(body)

    monkeypatch.setattr(json_bodies, "parse_json", recording)
    return seen


@pytest.fixture
def client() -> tuple[TestClient, list[int]]:
    loop_threads: list[int] = []
    router = APIRouter(route_class=json_bodies.off_loop_json_route(anyio.CapacityLimiter(1)))

    @router.post("/count")
    async def count(body: Tokens) -> dict[str, int]:
        loop_threads.append(threading.get_ident())  # an async route runs on the loop
        return {"n": len(body.tokens), "sum": sum(body.tokens)}

    app = FastAPI()
    app.include_router(router)
    return TestClient(app), loop_threads


def test_a_big_body_is_parsed_off_the_event_loop(
    client: tuple[TestClient, list[int]], parses: list[int]
) -> None:
    http, loop_threads = client
    tokens = list(range(40_000))  # ~230 KB of JSON: over INLINE_BYTES
    r = http.post("/count", json={"tokens": tokens})
    assert r.status_code == 200, r.text
    assert r.json() == {"n": len(tokens), "sum": sum(tokens)}
    assert len(parses) == 1 and parses[0] != loop_threads[0]


def test_a_small_body_stays_on_the_loop(
    client: tuple[TestClient, list[int]], parses: list[int]
) -> None:
    http, _ = client
    r = http.post("/count", json={"tokens": [1, 2, 3]})
    assert r.json() == {"n": 3, "sum": 6}
    assert parses == []


def test_a_big_malformed_body_is_fastapis_422(
    client: tuple[TestClient, list[int]], parses: list[int]
) -> None:
    http, _ = client
    body = b'{"tokens": [' + b"1," * 50_000 + b"]"  # cut short: not JSON
    r = http.post("/count", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert len(parses) == 1


def test_the_tinker_routes_are_built_that_way(parses: list[int]) -> None:
    from loraplex_engine.server.tinker.routes import mount_tinker

    app = FastAPI()
    mount_tinker(app, lambda: None, None, admin_token="t")  # type: ignore[arg-type, return-value]
    body = {"sampling_session_id": "x", "prompt": {"chunks": []}, "pad": "." * 100_000}
    TestClient(app, raise_server_exceptions=False).post("/api/v1/asample", json=body)
    assert len(parses) == 1
