"""The gateway's hop costs what a proxy must and no more: a real gateway process
(tests/support/gateway_process.py) in front of an upstream that answers in the engine's
shapes (a starlette app under uvicorn, here: no engine needed to see the hop) keeps its
upstream connections open across requests (one pooled client, not one per request) and
passes the engine's answers through byte for byte, streamed events included (no JSON
decoded and encoded again on the way back). bench/gateway_latency.py measures the cost.
"""

from __future__ import annotations

import json
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
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.support.gateway_process import GatewayProcess

KEY = "tml-passthrough-0123456789"
MODEL = "team-a.m"
# Spacing and key order no JSON encoder of ours would produce: a re-encoded body differs.
WHOLE = b'{"id":"c1",   "object" : "text_completion","choices":[{"text":"yes","index":0}]}'
EVENTS = [
    b'data: {"choices" :[{"text":"a"}],  "id":"c1"}\n\n',
    b'data: {"choices":[{"text":"b"}]}\n\n',
]
EVENTS.append(b"data: [DONE]\n\n")


class Upstream:
    """The upstream, recording each request's client address and body."""

    def __init__(self) -> None:
        self.peers: list[tuple[str, int]] = []
        self.bodies: list[dict[str, Any]] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        app = Starlette(
            routes=[
                Route("/v1/models/{id:path}", self.model),
                Route("/v1/completions", self.complete, methods=["POST"]),
            ]
        )
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})

    async def model(self, request: Request) -> Response:
        self.peers.append(request.scope["client"])
        found = request.path_params["id"] == MODEL
        return JSONResponse({"id": MODEL} if found else {"error": {}}, 200 if found else 404)

    async def complete(self, request: Request) -> Response:
        self.peers.append(request.scope["client"])
        doc = json.loads(await request.body())
        self.bodies.append(doc)
        if not doc.get("stream"):
            return Response(WHOLE, media_type="application/json")

        async def events() -> Iterator[bytes]:
            for event in EVENTS:
                yield event

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture()
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    up.thread.start()
    deadline = time.monotonic() + 20
    while not up.server.started:
        assert time.monotonic() < deadline, "upstream did not start"
        time.sleep(0.05)
    try:
        yield up
    finally:
        up.server.should_exit = True
        up.thread.join(10)


@pytest.fixture()
def gateway(upstream: Upstream, tmp_path: Path) -> Iterator[GatewayProcess]:
    engine = {"name": "e0", "pool": "p", "url": upstream.url, "token": "t"}
    view = {"engines": [engine], "keys": [{"namespace": "team-a", "key": KEY, "role": "sample"}]}
    gw = GatewayProcess(tmp_path, view).start()
    try:
        yield gw
    finally:
        gw.stop()


def test_upstream_connections_are_reused_and_answers_pass_byte_for_byte(
    upstream: Upstream, gateway: GatewayProcess
) -> None:
    n = 12
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=30) as client:
        for i in range(n):
            body = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": i % 2 == 1}
            if body["stream"]:
                with client.stream("POST", "/v1/completions", json=body) as r:
                    got = b"".join(r.iter_raw())
                assert r.status_code == 200 and got == b"".join(EVENTS)
            else:
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200 and r.content == WHOLE
    # the body reached the engine as sent, with the model's full id
    assert upstream.bodies[0] == {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": False}
    # Sequential requests: one pooled connection carries them all (a client made per
    # request would open n + 1, the adapter lookup included).
    assert len(upstream.peers) == n + 1  # n completions and one (cached) adapter lookup
    assert len(set(upstream.peers)) <= 2, set(upstream.peers)
