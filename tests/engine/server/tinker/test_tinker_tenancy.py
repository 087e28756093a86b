"""Tenants of one engine's Tinker routes cannot take each other's futures, models or slots,
against a real ``loraplex-engine serve`` (tiny model, 4 slots) and the official SDK:

- the futures table is bounded per namespace: a client at full speed for longer than the
  retention never sees a 429 (its retrieved futures go after a grace, its oldest finished
  ones make room); a tenant flooding pending calls hits its own cap, named in the 429,
  while another tenant's calls go on;
- a model id is the tenant's own (registry, sessions, lanes and futures keyed by
  namespace): team-a's client experiment under team-b's ``spec.client.modelId``, then
  called through team-a's delegation, leaves team-b's model and its session to team-b;
  and ``/metrics`` without the engine's token names no tenant;
- a namespace holds at most its share of the registered adapters
  (``--client-models-per-namespace``, by default half): team-a asking for every one leaves
  room for team-b's create_model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from tests.support.server_process import EngineServer
from tests.support.tinker_clients import close_all, service_client, sft

pytestmark = pytest.mark.slow

KEY_A = "tml-team-a-0123456789abcdef"
KEY_B = "tml-team-b-0123456789abcdef"
CAP = 20  # --tinker-futures-per-namespace
TTL_S = 2.0  # --tinker-future-ttl
GRACE_S = 0.5  # --tinker-retrieved-grace
SLOTS = 4
PROMPT = types.ModelInput.from_ints([1, 40, 41, 42])
ONE_TOKEN = types.SamplingParams(max_tokens=1, temperature=0.0)


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    work = tmp_path_factory.mktemp("tinker-tenancy")
    keys = work / "keys.txt"
    keys.write_text(f"team-a {KEY_A}\nteam-b {KEY_B}\n")
    flags = [
        "--tinker-keys", str(keys),
        "--tinker-futures-per-namespace", str(CAP),
        "--tinker-future-ttl", str(TTL_S),
        "--tinker-retrieved-grace", str(GRACE_S),
        "--max-registered", str(SLOTS),  # no paging: the share is of these 4
    ]  # fmt: skip
    srv = EngineServer(
        tiny_model_dir, work / "ckpt", max_adapters=SLOTS, workdir=work, extra_args=flags
    )
    with srv:
        yield srv


@pytest.fixture(autouse=True)
def _closed_clients() -> Iterator[None]:
    yield
    close_all()  # closing a session unloads its models: the next test finds the slots free


def _base(client: tinker.ServiceClient) -> str:
    return client.get_server_capabilities().supported_models[0].model_name


def _api(server: EngineServer, **headers: str) -> httpx.Client:
    return httpx.Client(base_url=server.url + "/api/v1", headers=headers, timeout=60)


def _as_ns(server: EngineServer, ns: str) -> httpx.Client:
    return _api(server, Authorization=f"Bearer {server.token}", **{"X-Loraplex-Namespace": ns})


def _retrieve(api: httpx.Client, request_id: str, timeout: float = 120) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = api.post("/retrieve_future", json={"request_id": request_id})
        if r.status_code == 408:  # pending: the SDK's quiet try-again
            continue
        if r.status_code != 200 or r.headers["content-type"].startswith("application/x-proto"):
            return r
        if r.json().get("type") != "try_again":
            return r
    raise AssertionError(f"{request_id} still pending after {timeout}s")


def _statuses_429(server: EngineServer) -> list[str]:
    return [line for line in server.log_path.read_text().splitlines() if " 429 " in line]


def test_a_client_at_full_speed_past_the_retention_never_sees_a_429(server) -> None:
    client = service_client(server.url, KEY_A)
    sampler = client.create_sampling_client(base_model=_base(client))
    tc = client.create_lora_training_client(base_model=_base(client), rank=2).result()
    data = [sft([1, 40, 41], [100, 101])]
    calls, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < 3 * TTL_S:
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        samples = [sampler.sample(PROMPT, 1, ONE_TOKEN) for _ in range(6)]
        fb.result(), opt.result(), [s.result() for s in samples]
        calls += 8
    assert calls > 3 * CAP, f"only {calls} futures: not past the cap, the test shows nothing"
    assert _statuses_429(server) == []


def test_a_flooding_tenant_hits_its_own_cap_and_the_other_goes_on(server) -> None:
    base = _base(service_client(server.url, KEY_A))
    heavy = {
        "base_model": base,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 40, 41, 42]}]},
        "num_samples": 16,
        "sampling_params": {"max_tokens": 400, "temperature": 1.0},
    }
    refused: list[httpx.Response] = []
    lock = threading.Lock()

    def flood() -> None:
        with _api(server, **{"X-API-Key": KEY_B}) as api:
            for _ in range(30):  # never retrieved: pending until the ticks get to them
                r = api.post("/asample", json=heavy)
                if r.status_code == 429:
                    with lock:
                        refused.append(r)

    flooders = [threading.Thread(target=flood) for _ in range(4)]
    for t in flooders:
        t.start()
    for t in flooders:
        t.join()
    assert refused, "120 pending calls past a cap of 20 were all taken"
    error = refused[0].json()["error"]
    assert "'team-b'" in error["message"] and f"per-namespace {CAP}" in error["message"]
    # team-a's calls still go in and are answered, behind team-b's queued work
    with _api(server, **{"X-API-Key": KEY_A}) as api:
        ok = {**heavy, "num_samples": 1, "sampling_params": {"max_tokens": 1}}
        posted = [api.post("/asample", json=ok) for _ in range(3)]
        assert [r.status_code for r in posted] == [200] * 3, posted[-1].text
        for r in posted:
            assert _retrieve(api, r.json()["request_id"], 300).status_code == 200


def _put_client_experiment(server: EngineServer, ns: str, name: str, model_id: str) -> Any:
    body = {
        "namespace": ns,
        "name": name,
        "spec": {
            "lora": {"rank": 2},
            "client": {"modelId": model_id},
            "algorithm": {"maxSteps": 0},
            "checkpoint": {"everySteps": 1, "keep": 1},
        },
    }
    with server.client() as api:
        return api.put(f"/v1/experiments/{ns}.{name}", json=body)


def _delete(server: EngineServer, *exp_ids: str) -> None:
    with server.client() as api:
        for exp_id in exp_ids:
            api.delete(f"/v1/experiments/{exp_id}")


def test_a_squatting_experiment_cannot_take_another_namespaces_model(server) -> None:
    session = "s" + "b" * 20
    victim, next_one = f"{session}:train:0", f"{session}:train:1"
    b0, b1 = f"tinker-{session}-0", f"tinker-{session}-1"
    try:
        assert _put_client_experiment(server, "team-b", b0, victim).status_code == 201
        # team-a learns team-b's id (e.g. from /metrics) and puts it in its own spec
        assert _put_client_experiment(server, "team-a", "squat", victim).status_code == 201
        with _as_ns(server, "team-a") as a:  # team-a's first call adopts "its" model
            assert a.post("/get_info", json={"model_id": victim}).status_code == 200
        with _as_ns(server, "team-b") as b:
            r = b.post("/get_info", json={"model_id": victim})
            assert r.status_code == 200, r.text
            assert _put_client_experiment(server, "team-b", b1, next_one).status_code == 201
            r = b.post("/get_info", json={"model_id": next_one})
            assert r.status_code == 200, r.text
            fut = b.post("/optim_step", json={"model_id": victim, "seq_id": 1, "adam_params": {}})
            assert fut.status_code == 200, fut.text
            rid = fut.json()["request_id"]
        with _as_ns(server, "team-a") as a:  # the same request id is not team-b's future
            same = a.post("/optim_step", json={"model_id": victim, "seq_id": 1, "adam_params": {}})
            assert same.status_code == 200 and same.json()["request_id"] == rid
            a.post("/retrieve_future", json={"request_id": rid})
        with _as_ns(server, "team-b") as b:
            assert "error" not in _retrieve(b, rid).json()
        # where team-a would have learnt the id: /metrics names tenants only to the token
        with server.client() as api:
            assert session in api.get("/metrics").text  # Prometheus's scrape: all series
        open_scrape = httpx.get(f"{server.url}/metrics", timeout=30)
        assert open_scrape.status_code == 200
        assert "loraplex_engine_free_slots" in open_scrape.text
        for tenant_id in (session, "team-b", "team-a"):
            assert tenant_id not in open_scrape.text
    finally:
        _delete(server, f"team-b.{b0}", f"team-b.{b1}", "team-a.squat")


def test_one_namespace_asking_for_every_slot_leaves_room_for_another(server) -> None:
    a = service_client(server.url, KEY_A)
    base = _base(a)
    created, refused = 0, []
    for _ in range(SLOTS):
        try:
            a.create_lora_training_client(base_model=base, rank=2).result(timeout=60)
            created += 1
        except tinker.RequestFailedError as e:
            refused.append(str(e))
    assert created == SLOTS // 2 and len(refused) == SLOTS - created
    assert "--client-models-per-namespace 2" in refused[0] and "'team-a'" in refused[0]
    r = _put_client_experiment(server, "team-a", "third", "third:train:0")
    assert r.status_code == 409 and "--client-models-per-namespace 2" in r.text, r.text
    b = service_client(server.url, KEY_B)
    tc = b.create_lora_training_client(base_model=base, rank=2)
    assert tc.result(timeout=60).get_info().lora_rank == 2
