"""A Tinker model paged to the disk tier (memory/spill.py) survives an engine restart
through its checkpoint: a real ``loraplex-engine serve`` with two slots and a 1-byte
``--host-adapter-memory`` (every paged-out model is a file on the checkpoint volume), a
client experiment (the model the gateway creates for a Tinker ``create_model``, driven
here as the gateway drives it: the raw protocol under the engine's token and the
namespace header) crowded out of its slot onto disk, the engine killed with SIGKILL and
started again on the same checkpoint root. The model resumes at its checkpointed step and
its next steps' losses are bit for bit those of a model that never left its slot. The
dead engine's spill files are swept at the restart, a deleted model's go with it (its page
dropped, no other model paged out for it), and a
clean restart leaves only the live engine's directory: nothing grows across restarts."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from tests.support.server_process import EngineServer
from tests.support.tinker_clients import sft

pytestmark = pytest.mark.slow

NS = "team-a"
DATA = [
    sft([1, 40, 41], [100, 101, 102]),
    sft([1, 50, 51, 52], [200, 201]),
    sft([1, 60], [110, 111, 112, 113]),
    sft([1, 70, 71], [120, 121]),
]
PROTO = {"Content-Type": "application/x-protobuf"}


def _ids(n: int) -> tuple[str, str]:
    """(experiment name, model id): the gateway's pair for session ``s<n...>``."""
    session = "s" + f"{n:020d}"
    return f"tinker-{session}-0", f"{session}:train:0"


def _put(srv: EngineServer, n: int, seed: int) -> dict[str, Any]:
    name, model = _ids(n)
    spec = {
        "lora": {"rank": 4},
        "client": {"modelId": model, "seed": seed},
        "algorithm": {"maxSteps": 0},
        "checkpoint": {"everySteps": 1, "keep": 2},
    }
    with srv.client() as api:
        r = api.put(
            f"/v1/experiments/{NS}.{name}", json={"namespace": NS, "name": name, "spec": spec}
        )
    assert r.status_code == 201, r.text
    return r.json()


def _tinker(srv: EngineServer) -> httpx.Client:
    headers = {"Authorization": f"Bearer {srv.token}", "X-Loraplex-Namespace": NS}
    return httpx.Client(base_url=srv.url + "/api/v1", headers=headers, timeout=60)


def _answer(api: httpx.Client, r: httpx.Response, timeout: float = 300) -> httpx.Response:
    assert r.status_code == 200, r.text
    rid, deadline = r.json()["request_id"], time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = api.post("/retrieve_future", json={"request_id": rid})
        if got.status_code == 408 or (
            got.headers["content-type"].startswith("application/json")
            and got.json().get("type") == "try_again"
        ):
            continue
        assert got.status_code == 200, got.text
        return got
    raise AssertionError(f"{rid} still pending after {timeout}s")


def _steps(srv: EngineServer, n: int, seqs: range) -> list[float]:
    """forward_backward then optim_step per pair of ``seqs``; the losses."""
    model, losses = _ids(n)[1], []
    with _tinker(srv) as api:
        for seq in seqs[::2]:
            req = types.ForwardBackwardRequest(
                forward_backward_input=types.ForwardBackwardInput(
                    data=[DATA[(seq // 2) % len(DATA)]], loss_fn="cross_entropy"
                ),
                model_id=model,
                seq_id=seq,
            )
            body = forward_backward_request_to_proto(req).SerializeToString()
            got = _answer(api, api.post("/forward_backward", content=body, headers=PROTO))
            losses.append(deserialize_forward_backward_output(got.content).metrics["loss:sum"])
            optim = {"model_id": model, "seq_id": seq + 1, "adam_params": {"learning_rate": 0.01}}
            _answer(api, api.post("/optim_step", json=optim))
    return losses


def _capacity(srv: EngineServer) -> dict[str, Any]:
    with srv.client() as api:
        return api.get("/v1/capacity").json()


def _spill_entries(root: Path) -> list[Path]:
    where = root / ".paged-adapters"
    return sorted(where.iterdir()) if where.is_dir() else []


def _spilled_files(root: Path) -> list[Path]:
    return sorted(root.glob(".paged-adapters/*/*.safetensors"))


@pytest.fixture
def srv(tiny_model_dir: Path, tmp_path: Path) -> Iterator[EngineServer]:
    server = EngineServer(
        tiny_model_dir, tmp_path / "ckpt", max_adapters=2, workdir=tmp_path,
        extra_args=["--host-adapter-memory", "1", "--client-models-per-namespace", "8"],
    )  # fmt: skip
    try:
        yield server.start()
    finally:
        server.kill()


def test_a_model_on_disk_survives_kill_9_and_resumes_bit_for_bit(srv: EngineServer) -> None:
    root = srv.checkpoint_root
    # The reference: alone on the engine, never paged, 4 steps; then deleted.
    _put(srv, 0, seed=3)
    reference = _steps(srv, 0, range(1, 9))
    with srv.client() as api:
        assert api.delete(f"/v1/experiments/{NS}.{_ids(0)[0]}").status_code in (200, 204)

    # The same model (seed, data) again: 2 steps, then two more models take both slots.
    _put(srv, 1, seed=3)
    first = _steps(srv, 1, range(1, 5))
    for n in (2, 3):
        _put(srv, n, seed=n)
        _steps(srv, n, range(1, 3))
    capacity = _capacity(srv)
    assert capacity["pagedAdapters"] == 1 and capacity["spilledAdapters"] == 1, capacity
    (dead_file,) = _spilled_files(root)  # model 1, least recently used, on disk
    srv.kill()  # SIGKILL: no close, no cleanup
    assert dead_file.exists()

    srv.start()  # the same checkpoint root
    assert not dead_file.exists() and not dead_file.parent.exists()  # swept: no owner
    assert len(_spill_entries(root)) == 2  # the live engine's directory and its lock
    status = _put(srv, 1, seed=3)
    assert status["step"] == 2  # its checkpoint, written at its last optim_step
    resumed = _steps(srv, 1, range(5, 9))
    assert first + resumed == reference  # bit for bit: what a resident model computed

    # A deleted model's spill file goes with it.
    for n in (2, 3):
        _put(srv, n, seed=n)
        _steps(srv, n, range(3, 5))
    (spilled,) = _spilled_files(root)  # model 1's again
    assert _capacity(srv)["spilledAdapters"] == 1
    with srv.client() as api:  # a delete drops its page as it is: nothing else goes out
        assert api.delete(f"/v1/experiments/{NS}.{_ids(1)[0]}").status_code in (200, 204)
        assert not spilled.exists() and _spilled_files(root) == []
        for n in (2, 3):
            assert api.delete(f"/v1/experiments/{NS}.{_ids(n)[0]}").status_code in (200, 204)
    assert _spilled_files(root) == [] and _capacity(srv)["spilledAdapters"] == 0

    # Clean restarts: each leaves only the live engine's directory.
    for _ in range(2):
        assert srv.stop() == 0
        assert _spill_entries(root) == []
        srv.start()
        assert len(_spill_entries(root)) == 2
