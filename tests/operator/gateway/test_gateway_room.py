"""Where the gateway puts a new Tinker session: the engine with the most room for one
more model, as the engine's ``/v1/capacity`` reports it (routing.registered_room). A
paging engine whose slots are all taken still registers up to ``maxRegistered``; an
engine with a free slot but nearly all its registrations used has less room. A real
gateway process (tests/support/gateway_process.py) in front of two upstreams that answer
in the engine's shapes (starlette apps under uvicorn standing in for the engines: what
is tested is the gateway's choice, which needs two engines' capacity answers set to
exact values a real engine reaches only after hundreds of models)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.support.gateway_process import GatewayProcess

KEY = "tml-room-0123456789abcdef"
SID = "s0123456789abcdef0123"


class FakeEngine:
    """Answers ``/v1/capacity`` as given and counts the sessions created on it."""

    def __init__(self, capacity: dict[str, Any]) -> None:
        self.capacity, self.sessions = capacity, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        app = Starlette(
            routes=[
                Route("/v1/capacity", self.report),
                Route("/api/v1/create_session", self.create, methods=["POST"]),
            ]
        )
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})

    async def report(self, request: Request) -> Response:
        return JSONResponse(self.capacity)

    async def create(self, request: Request) -> Response:
        self.sessions += 1
        return JSONResponse({"session_id": SID, "type": "create_session"})


@pytest.fixture()
def engines() -> Iterator[dict[str, FakeEngine]]:
    made = {
        # one slot free, but 7 of its 8 registrations used: room for 1
        "a-slots": FakeEngine({"freeSlots": 1, "usedSlots": 7, "maxRegistered": 8}),
        # every slot resident, 100 paged out of 512: room for 404
        "b-paging": FakeEngine(
            {"freeSlots": 0, "usedSlots": 8, "maxRegistered": 512, "pagedAdapters": 100}
        ),
    }
    for e in made.values():
        e.thread.start()
    deadline = time.monotonic() + 20
    while not all(e.server.started for e in made.values()):
        assert time.monotonic() < deadline, "upstreams did not start"
        time.sleep(0.05)
    try:
        yield made
    finally:
        for e in made.values():
            e.server.should_exit = True
            e.thread.join(10)


def test_a_new_session_goes_to_the_engine_with_registered_room(
    engines: dict[str, FakeEngine], tmp_path: Path
) -> None:
    view = {
        "engines": [
            {"name": name, "pool": name, "url": e.url, "token": "t"} for name, e in engines.items()
        ],
        "keys": [{"namespace": "team-a", "key": KEY, "role": "train"}],
    }
    gw = GatewayProcess(tmp_path, view).start()
    try:
        headers = {"X-API-Key": KEY}
        with httpx.Client(base_url=gw.url + "/api/v1", headers=headers, timeout=30) as api:
            r = api.post("/create_session", json={"tags": [], "sdk_version": "0"})
            assert r.status_code == 200, r.text
        assert (engines["b-paging"].sessions, engines["a-slots"].sessions) == (1, 0)
    finally:
        gw.stop()
