"""One queue per model orders its calls: the engine's (``TrainingService.submit``), by the
SDK's ``seq_id``; the protocol (server/tinker/protocol.py) puts each call on it before
answering the request and keeps no order of its own. Real engines with the tiny model:
the protocol in process (what the server holds while calls are queued), and a real
``loraplex-engine serve --tinker-keys`` driven over HTTP (raw protocol, so the calls can
be sent out of ``seq_id`` order, which the SDK never does)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from loraplex_engine.server.tinker.journal import find_future
from loraplex_engine.server.tinker.protocol import Protocol
from loraplex_engine.server.tinker.wire import PROTOBUF
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.support.engine_builders import engine
from tests.support.server_process import EngineServer
from tests.support.tinker_clients import close_all, service_client, sft

NS = "team-a"
KEY = "tml-team-a-0123456789abcdef"
STEP = {"learning_rate": 0.05}
GATHER_S = 3.0  # serve's window: the out-of-order calls all arrive within it
DEADLINE_S = 120.0  # liveness guard, not a speed target


def fb_body(model_id: str, seq: int) -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[sft([1, 40, 41, 42], [100, 101, 102, 103])], loss_fn="cross_entropy"
        ),
        model_id=model_id,
        seq_id=seq,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


def test_the_server_holds_no_order_of_its_own(tiny_model_dir: Path, tmp_path: Path) -> None:
    """An optim_step (seq 3) and the forward_backward it follows (seq 2), sent in that
    order: once the protocol has answered each request, the call is on the engine's
    queue, and the queue holds them in seq_id order; the server holds nothing per model
    meanwhile (its runner is a thread pool and parked creations, none parked). A tick
    then steps the forward_backward's gradient."""
    eng = engine(tiny_model_dir, tmp_path, max_adapters=2)
    p = Protocol(lambda: eng.clients)
    try:
        session = p.registry.new_session(NS, None)
        body = {"session_id": session.id, "model_seq_id": 0, "lora_config": {"rank": 4}}
        done(p, p.create_model(NS, body))  # a creation needs no tick
        model_id = f"{session.id}:train:0"
        step = p.optim_step(NS, {"model_id": model_id, "seq_id": 3, "adam_params": STEP})
        grad = p.forward_backward(NS, fb_body(model_id, 2), None)
        queue = eng.clients.loaded(NS, model_id).queue
        assert [(op.kind, op.order) for op in queue] == [("forward_backward", 2), ("optim_step", 3)]
        assert set(vars(p.runner)) == {"retry_s", "_pool", "_lock", "_parked", "_wake", "_stop",
                                       "_thread"}  # fmt: skip
        assert p.runner.parked() == 0
        stop = threading.Event()
        loop = threading.Thread(target=lambda: tick_until(eng, stop), daemon=True)
        loop.start()
        try:
            done(p, grad)
            assert done(p, step)["metrics"]["grad_norm:mean"] > 0
        finally:
            stop.set()
            loop.join()
    finally:
        p.close()
        eng.close()


def tick_until(eng: Any, stop: threading.Event) -> None:
    while not stop.is_set():
        if eng.tick() is None:
            time.sleep(0.002)


def done(p: Protocol, rid: str) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        fut = find_future(p, NS, rid)
        if fut is not None and fut.state in ("done", "failed"):
            assert fut.state == "done", fut.error
            return fut.result
        time.sleep(0.01)
    raise TimeoutError(rid)


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    work = tmp_path_factory.mktemp("order")
    keys = work / "keys.txt"
    keys.write_text(f"{NS} {KEY}\n")
    srv = EngineServer(
        tiny_model_dir, work / "ckpt", max_adapters=4, workdir=work,
        extra_args=["--tinker-keys", str(keys), "--client-tick-gather", str(GATHER_S)],
    )  # fmt: skip
    with srv:
        yield srv
    close_all()


def post(srv: EngineServer, route: str, content_type: str | None = None, **kw: Any) -> Any:
    headers = {"X-API-Key": KEY} | ({"Content-Type": content_type} if content_type else {})
    r = httpx.post(f"{srv.url}/api/v1/{route}", headers=headers, timeout=30, **kw)
    r.raise_for_status()
    return r.json()


def answer(srv: EngineServer, request_id: str) -> httpx.Response:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        r = httpx.post(
            f"{srv.url}/api/v1/retrieve_future",
            headers={"X-API-Key": KEY},
            json={"request_id": request_id},
            timeout=30,
        )
        r.raise_for_status()
        if r.headers["content-type"] == PROTOBUF or r.json().get("type") != "try_again":
            return r
    raise TimeoutError(request_id)


@pytest.mark.slow
def test_calls_sent_out_of_seq_order_run_in_seq_order(server: EngineServer) -> None:
    """A model's optim_step (seq 1001) reaches the engine before the forward_backward
    (seq 1000) it follows. Another client the last tick served holds the next tick's
    gather open (its next step is on its way), so both calls are queued before a tick
    takes either: the tick runs the forward_backward first and the step has its
    gradient (in arrival order the step would run alone, with none)."""
    client = service_client(server.url, KEY)
    base = client.get_server_capabilities().supported_models[0].model_name
    tc = client.create_lora_training_client(base_model=base, rank=4, seed=1).result()
    other = client.create_lora_training_client(base_model=base, rank=4, seed=2).result()
    other.forward_backward([sft([1, 50], [60, 61])], "cross_entropy").result()
    other.optim_step(types.AdamParams(learning_rate=0.01)).result()  # served, answered
    step = post(
        server, "optim_step", json={"model_id": tc.model_id, "seq_id": 1001, "adam_params": STEP}
    )
    grad = post(
        server,
        "forward_backward",
        content_type=PROTOBUF,
        content=fb_body(tc.model_id, 1000),
    )
    assert answer(server, grad["request_id"]).headers["content-type"] == PROTOBUF
    metrics = answer(server, step["request_id"]).json()["metrics"]
    assert metrics["grad_norm:mean"] > 0
