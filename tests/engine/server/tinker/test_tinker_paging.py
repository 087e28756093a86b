"""The official tinker SDK, unchanged, against a real ``loraplex-engine serve --tinker-keys``
with two adapter slots and paging (memory/paging.py): a model paged out between its
``forward_backward`` and its ``optim_step`` (its gradient accumulated, not stepped) goes on
bit for bit as a model that never left its slot (the same losses; the same saved weights
and Adam moments), and more models than slots all train at once, no call answered 404
or 409 because its model was paged out."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from safetensors.torch import load_file
from tinker import types

from tests.support.server_process import EngineServer
from tests.support.tinker_clients import service_client, sft

pytestmark = pytest.mark.slow

KEY = "tml-team-a-0123456789abcdef"
DATA = [
    [sft([1, 40, 41], [100, 101, 102])],
    [sft([1, 50, 51, 52], [200, 201])],
    [sft([1, 60], [110, 111, 112, 113])],
]
ADAM = types.AdamParams(learning_rate=0.01)


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    work = tmp_path_factory.mktemp("tinker-paging")
    keys = work / "keys.txt"
    keys.write_text(f"team-a {KEY}\n")
    srv = EngineServer(
        tiny_model_dir, work / "ckpt", max_adapters=2, workdir=work,
        extra_args=["--tinker-keys", str(keys), "--client-models-per-namespace", "16"],
    )  # fmt: skip
    with srv:
        yield srv


def _create(client: tinker.ServiceClient, seed: int, rank: int = 4) -> tinker.TrainingClient:
    base = client.get_server_capabilities().supported_models[0].model_name
    return client.create_lora_training_client(base_model=base, rank=rank, seed=seed).result()


def _saved(server: EngineServer, tc: tinker.TrainingClient, name: str) -> dict:
    tc.save_state(name).result()
    (directory,) = (server.checkpoint_root / "team-a").glob(f"*/{tc.model_id}/weights/{name}")
    return {f.name: load_file(f) for f in sorted(directory.glob("*.safetensors"))}


def _run(server: EngineServer, tc: tinker.TrainingClient, between=None) -> tuple[list, dict]:
    losses = []

    def fb(i: int) -> None:
        losses.append(tc.forward_backward(DATA[i], "cross_entropy").result().metrics["loss:sum"])

    fb(0), tc.optim_step(ADAM).result(), fb(1)  # fb(1)'s gradient: accumulated, not stepped
    if between is not None:
        between()
    fb(2), tc.optim_step(ADAM).result(), fb(0), tc.optim_step(ADAM).result()
    return losses, _saved(server, tc, "end")


def test_a_model_paged_out_mid_accumulation_resumes_bit_for_bit(server) -> None:
    client = service_client(server.url, KEY)
    alone_losses, alone = _run(server, _create(client, seed=3))

    def crowd() -> None:  # two more models on two slots: the paged one's slot goes
        for seed in (11, 12):
            other = _create(client, seed=seed, rank=8)
            other.forward_backward(DATA[1], "cross_entropy").result()
            other.optim_step(ADAM).result()

    paged_losses, paged = _run(server, _create(client, seed=3), crowd)
    assert paged_losses == alone_losses
    assert paged.keys() == alone.keys() and paged
    for file, tensors in alone.items():
        for key, tensor in tensors.items():
            assert paged[file][key].equal(tensor), (file, key)
    client.close("success").result()


def test_more_models_than_slots_all_train_at_once(server) -> None:
    client = service_client(server.url, KEY)
    models = [_create(client, seed=i) for i in range(6)]  # 6 models, 2 slots
    losses: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def loop(i: int) -> None:
        try:
            for _ in range(4):
                out = models[i].forward_backward(DATA[i % 3], "cross_entropy").result()
                models[i].optim_step(types.AdamParams(learning_rate=0.02)).result()
                losses.setdefault(i, []).append(out.metrics["loss:sum"])
        except BaseException as e:  # any 404/409 of a paged model lands here
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert sorted(losses) == list(range(6))
    # Each stepped 4 times (equal to training alone up to rounding, whatever the ticks'
    # grouping: tests/engine/memory/test_paging.py).
    assert all(len(v) == 4 and all(math.isfinite(x) for x in v) for v in losses.values())
    client.close("success").result()
