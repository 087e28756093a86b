"""Adapter paging (memory/paging.py) on a real Engine with the tiny model: an adapter
paged out to host memory and back continues bit for bit as if it had stayed in its slot
(losses, weights, both Adam moments, a client's accumulated gradient), and an engine with
more registered adapters than slots trains every one of them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from loraplex_engine.memory.spill import SpilledPage, read
from loraplex_engine.spec.training_service import AdamStep, ClientLora, LossCall

from tests.support.client_driver import NS, drive, sft_datum
from tests.support.engine_builders import engine, run_to_end, spec

CE = LossCall("cross_entropy")
DATA = [
    [sft_datum([1, 40, 41], [100, 101, 102])],
    [sft_datum([1, 50, 51, 52], [200, 201])],
    [sft_datum([1, 60], [110, 111, 112, 113])],
]
ADAM = AdamStep(learning_rate=0.01)


def _weights_and_moments(eng, name: str) -> dict[str, torch.Tensor]:
    state = eng.optimizer.state_dict(name)
    moments = {f"m:{k}": v for k, v in state["exp_avg"].items()}
    moments |= {f"v:{k}": v for k, v in state["exp_avg_sq"].items()}
    return eng.model.adapter_state_dict(name) | moments


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:2]}"


def _client_run(eng, model_id: str, between=None) -> tuple[list[float], dict]:
    """forward_backward, optim_step, forward_backward (accumulated, not stepped), then
    ``between`` (which may page the model out), then forward_backward, optim_step twice."""
    clients = eng.clients
    clients.create_model(NS, model_id, ClientLora(rank=4, seed=3))
    losses = []

    def fb(i: int) -> None:
        (out,) = drive(eng, lambda: clients.forward_backward(NS, model_id, DATA[i], CE))
        losses.append(out.metrics["loss:sum"])

    def step() -> None:
        drive(eng, lambda: clients.optim_step(NS, model_id, ADAM))

    fb(0), step(), fb(1)
    if between is not None:
        between()
    fb(2), step(), fb(0), step()
    name = clients.loaded(NS, model_id).name
    eng.pager.page_in(name)
    return losses, _weights_and_moments(eng, name)


@pytest.fixture
def eng(tiny_model_dir: Path, tmp_path: Path):
    e = engine(tiny_model_dir, tmp_path, max_adapters=2, client_models_per_namespace=8)
    yield e
    e.close()


@pytest.mark.parametrize("host_memory", [None, 1], ids=["host", "spilled-to-volume"])
def test_a_paged_client_model_keeps_its_accumulated_gradient_bit_for_bit(
    tiny_model_dir: Path, tmp_path: Path, host_memory: int | None
) -> None:
    """In host memory, or (a 1-byte host budget) written to the checkpoint volume."""
    eng = engine(
        tiny_model_dir, tmp_path, max_adapters=2, client_models_per_namespace=8,
        host_adapter_memory=host_memory,
    )  # fmt: skip
    try:
        _paged_vs_alone(eng, spilled=host_memory is not None)
    finally:
        eng.close()
    assert not list(tmp_path.glob(".paged-adapters/*/*"))  # the engine's spill went with it


def _paged_vs_alone(eng, spilled: bool) -> None:
    assert eng.pager.max_registered == 2 * 64  # the default: 64 per slot
    alone_losses, alone = _client_run(eng, "alone")
    drive(eng, lambda: eng.clients.unload_model(NS, "alone", save=False))
    paged_names = []

    def crowd() -> None:  # two other models take both slots: "paged" must leave its own
        for other in ("f1", "f2"):
            eng.clients.create_model(NS, other, ClientLora(rank=8, seed=1))
        drive(
            eng,
            *(lambda o=o: eng.clients.forward_backward(NS, o, DATA[1], CE) for o in ("f1", "f2")),
        )
        paged = eng.clients.loaded(NS, "paged").name
        assert eng.pager.is_paged(paged)
        page = eng.pager.pages[paged]
        assert isinstance(page, SpilledPage) == spilled
        assert eng.capacity().spilled_adapters >= spilled
        page = read(page) if spilled else page
        assert page.grads is not None  # the unstepped gradient went with it
        paged_names.append(paged)

    paged_losses, paged = _client_run(eng, "paged", crowd)
    assert paged_names and eng.pager.stats.page_ins >= 1
    assert paged_losses == alone_losses
    _assert_identical(paged, alone)


def test_a_paged_experiment_trains_as_if_it_had_stayed(tiny_model_dir: Path, tmp_path: Path):
    alone = engine(tiny_model_dir, tmp_path / "alone", max_adapters=1, max_registered=1)
    try:
        alone.put_experiment("a", spec(steps=4, seed=7))
        alone_curve = run_to_end(alone, ["a"])["a"]
        alone_weights = _weights_and_moments(alone, "a")
    finally:
        alone.close()
    shared = engine(tiny_model_dir, tmp_path / "shared", max_adapters=1)  # paging: 64 on 1
    try:
        shared.put_experiment("a", spec(steps=4, seed=7))
        shared.put_experiment("b", spec(steps=4, seed=8))  # one slot: "b" waits paged
        assert shared.pager.is_paged("b") and not shared.pager.is_paged("a")
        curves = run_to_end(shared, ["a", "b"])
        assert shared.pager.stats.page_ins >= 4  # they took turns in the one slot
        shared.pager.page_in("a")
        _assert_identical(_weights_and_moments(shared, "a"), alone_weights)
        assert curves["a"] == alone_curve and len(curves["b"]) == 4
    finally:
        shared.close()


def _crowd_losses(eng, ids: list[str], rounds: int = 3) -> list[list[float]]:
    for n, i in enumerate(ids):
        eng.clients.create_model(NS, i, ClientLora(rank=4, seed=n))
    losses = []
    for _ in range(rounds):
        outs = drive(
            eng,
            *(lambda n=n, i=i: eng.clients.forward_backward(NS, i, DATA[n % 3], CE)
              for n, i in enumerate(ids)),
            *(lambda i=i: eng.clients.optim_step(NS, i, ADAM) for i in ids),
        )  # fmt: skip
        losses.append([o.metrics["loss:sum"] for o in outs[: len(ids)]])
    return losses


def test_more_registered_models_than_slots_all_train(eng, tiny_model_dir, tmp_path) -> None:
    """7 models on 2 slots train as 7 models on 8 slots do (the same steps; the ticks
    group them differently, so the fused passes agree to rounding, not to the bit)."""
    ids = [f"m{i}" for i in range(7)]
    crowded = _crowd_losses(eng, ids)
    assert eng.pager.registered() == 7 and len(eng.pager.pages) == 5
    assert eng.pager.stats.page_ins >= 10
    capacity = eng.capacity()  # what GET /v1/capacity and /metrics report
    assert (capacity.used_slots, capacity.paged_adapters, capacity.max_registered) == (2, 5, 128)
    assert capacity.page_ins == eng.pager.stats.page_ins and capacity.paged_host_bytes > 0
    assert len(capacity.experiments) == 7 and capacity.free_slots == 0
    for i in ids:
        name = eng.clients.loaded(NS, i).name
        eng.pager.page_in(name)
        assert eng.optimizer.step_count(name) == 3
    roomy = engine(
        tiny_model_dir, tmp_path / "roomy", max_adapters=8, max_registered=8,
        client_models_per_namespace=8,
    )  # fmt: skip
    try:
        np.testing.assert_allclose(_crowd_losses(roomy, ids), crowded, rtol=1e-4)
        assert roomy.pager.stats.page_ins == 0
    finally:
        roomy.close()


def test_a_failed_page_in_keeps_the_page(eng, monkeypatch) -> None:
    for i in ("x", "y", "z"):  # 3 models, 2 slots
        eng.clients.create_model(NS, i, ClientLora(rank=4, seed=0))
    name = eng.clients.loaded(NS, "x").name
    eng.pager.page_out(name)  # "x" paged out; "z" (registered paged) takes its slot
    eng.pager.page_in(eng.clients.loaded(NS, "z").name)
    page, free = eng.pager.pages[name], eng.model.free_slots()
    real = eng.optimizer.load_state_dict

    def broken(*args, **kwargs):
        raise MemoryError("no room for the moments")

    monkeypatch.setattr(eng.optimizer, "load_state_dict", broken)
    with pytest.raises(MemoryError):
        eng.pager.page_in(name)
    assert eng.pager.pages[name] is page and name not in eng.model.adapters()
    assert not eng.optimizer.has_adapter(name) and len(eng.model.free_slots()) == len(free) + 1
    monkeypatch.setattr(eng.optimizer, "load_state_dict", real)
    eng.pager.page_in(name)
    _assert_identical(eng.model.adapter_state_dict(name), page.weights)


def test_registering_past_the_slots_pages_nothing_out_and_trains_bit_for_bit(eng) -> None:
    """With both slots taken, registering is bookkeeping (a fresh page, no page-out on
    the request's thread); the model's first call pages it in (never a 404 or 409), and it
    trains bit for bit as a model registered into a free slot does."""
    alone_losses, alone = _client_run(eng, "alone")
    drive(eng, lambda: eng.clients.unload_model(NS, "alone", save=False))
    for other in ("f1", "f2"):  # both slots taken
        eng.clients.create_model(NS, other, ClientLora(rank=8, seed=1))
    outs, ins = eng.pager.stats.page_outs, eng.pager.stats.page_ins
    for extra in ("e1", "e2", "e3"):
        eng.clients.create_model(NS, extra, ClientLora(rank=4, seed=5))
    assert (eng.pager.stats.page_outs, eng.pager.stats.page_ins) == (outs, ins)
    assert eng.pager.registered() == 5 and eng.capacity().spilled_adapters == 0
    fresh_losses, fresh = _client_run(eng, "fresh")  # registered with no slot free
    assert fresh_losses == alone_losses
    _assert_identical(fresh, alone)
    assert eng.pager.stats.first_slots >= 1
    stats = (eng.pager.stats.page_outs, eng.pager.stats.page_ins, eng.pager.stats.first_slots)
    drive(eng, lambda: eng.clients.unload_model(NS, "e1", save=False))  # never called
    assert (eng.pager.stats.page_outs, eng.pager.stats.page_ins) == stats[:2]
    assert eng.pager.stats.first_slots == stats[2] and eng.pager.registered() == 5


def test_max_registered_below_the_slots_or_without_paging_is_refused() -> None:
    from loraplex_engine.memory.paging import registered_limit
    from loraplex_engine.spec.errors import UsageError

    assert registered_limit(8, None, supported=True) == 512
    assert registered_limit(8, None, supported=False) == 8
    with pytest.raises(UsageError, match="below --max-adapters"):
        registered_limit(8, 4, supported=True)
    with pytest.raises(UsageError, match="--schedule sync"):
        registered_limit(8, 9, supported=False)
