"""What tinker-cookbook's recipes take for granted of a Tinker server, over the real SDK
against the protocol (TEST DOUBLE engine: tinker_double.FakeTraining, served by
tests/support/tinker_server.py as for test_tinker_protocol.py): the base model answers to
its hub id, the engine's own saves never take a name a client can write, a run's metadata
outlives its model, a route the engine lacks says so, and a pending future is not an SDK
warning."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from loraplex_engine.spec.training_service import OptimStep
from tinker import types

from tests.support.tinker_double import FakeTraining
from tests.support.tinker_server import BASE, KEY_A, Server

HUB_ID = "Qwen/Qwen3-4B-Instruct-2507"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path, served_names=(HUB_ID,))
    yield s
    s.stop()


def test_the_base_model_answers_to_every_served_name(server: Server) -> None:
    caps = server.rest().get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [BASE, HUB_ID]
    client = server.client()
    tc = client.create_lora_training_client(base_model=HUB_ID, rank=2).result()
    assert tc.get_info().model_data.model_name == BASE
    sampler = client.create_sampling_client(base_model=HUB_ID).result()
    out = sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=1))
    assert len(out.result().sequences) == 1
    with pytest.raises(Exception, match="Qwen/Qwen3-4B-Instruct-2507"):
        client.create_lora_training_client(base_model="Qwen/Other", rank=2).result()


def test_a_client_cannot_write_a_name_the_engine_saves_under(server: Server) -> None:
    tc = server.client().create_lora_training_client(base_model=BASE, rank=2).result()
    with pytest.raises(Exception, match="reserved"):
        tc.save_state("loraplex-final").result()
    assert tc.save_state("final").result().path.endswith("/weights/final")


def test_the_engines_save_at_session_end_is_not_the_clients_final(server: Server) -> None:
    tc = server.client().create_lora_training_client(base_model=BASE, rank=2).result()
    tc.save_state("final").result()
    server.proto.registry.session_ttl_s = 0.5  # below the SDK's 10 s heartbeat
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ("unload_model", "team-a", tc.model_id) not in (
        server.training.log
    ):
        time.sleep(0.1)
    saves = [c for c, _, m in server.training.log if m == tc.model_id and c.startswith("save")]
    assert saves[0] == "save_state:weights:final"
    assert [s for s in saves[1:] if not s.startswith("save_state:weights:loraplex-")] == []


def test_a_runs_metadata_and_rank_outlive_its_model(server: Server) -> None:
    client = server.client()
    meta = {"recipe": "sl_loop"}
    tc = client.create_lora_training_client(base_model=BASE, rank=4, user_metadata=meta).result()
    tc.save_state("s").result()
    server.proto.end_session("team-a", client.holder.get_session_id())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.proto.registry.models("team-a"):
        time.sleep(0.05)
    run = server.rest().get_training_run(tc.model_id).result()
    assert run.lora_rank == 4 and run.user_metadata == meta


@pytest.mark.parametrize("route", ["/api/v1/no_such_route", "/api/v1/sessions/s1/search"])
def test_a_route_the_engine_lacks_says_it_is_not_supported(server: Server, route: str) -> None:
    r = httpx.post(f"{server.url}{route}", json={}, headers={"X-API-Key": KEY_A})
    assert r.status_code == 404
    assert "not supported" in r.json()["error"]["message"], r.text


class HeldTraining(FakeTraining):
    """The double, with optimiser steps held until ``release`` is set."""

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)
        self.release = threading.Event()

    def submit(self, namespace: str, model_id: str, call: object, order: object = None) -> object:
        if not isinstance(call, OptimStep):
            return super().submit(namespace, model_id, call, order)
        held = self

        class Held:  # queued at once; answered once released, as the engine's tick would
            def wait(self) -> object:
                held.release.wait(10)
                return held.optim_step(namespace, model_id, call.adam)

        return Held()


def test_a_pending_future_answers_the_sdks_quiet_retry(tmp_path: Path) -> None:
    # The SDK logs a warning for each {"type": "try_again"} answered 200, and retries a
    # 408 carrying queue_state silently (tinker/lib/api_future_impl.py).
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from loraplex_engine.server.tinker.keys import KeyStore
    from loraplex_engine.server.tinker.routes import mount_tinker

    (tmp_path / "keys").write_text(f"team-a {KEY_A}\n")
    training = HeldTraining(BASE, str(tmp_path), slots=2)
    app = FastAPI()
    proto = mount_tinker(app, lambda: training, KeyStore(str(tmp_path / "keys")), long_poll_s=0.05)
    api = TestClient(app, headers={"X-API-Key": KEY_A})
    try:
        session = api.post("/api/v1/create_session", json={}).json()["session_id"]
        body = {"session_id": session, "model_seq_id": 0, "base_model": BASE}
        rid = api.post("/api/v1/create_model", json={**body, "lora_config": {"rank": 2}})
        model = _result(api, rid.json()["request_id"])["model_id"]
        step = api.post("/api/v1/optim_step", json={"model_id": model, "adam_params": {}})
        r = api.post("/api/v1/retrieve_future", json={"request_id": step.json()["request_id"]})
        assert r.status_code == 408 and r.json()["queue_state"] == "active", r.text
        training.release.set()
        assert "metrics" in _result(api, step.json()["request_id"])
    finally:
        training.release.set()
        proto.close()


def _result(api: object, request_id: str) -> dict:
    for _ in range(200):
        r = api.post("/api/v1/retrieve_future", json={"request_id": request_id})  # type: ignore[attr-defined]
        if r.status_code == 200:
            return r.json()
    raise AssertionError(f"{request_id} still pending")
