"""Spilled adapter pages count against their namespace's checkpoint quota
(store/spill_quota.py), on a real Engine with the tiny model: 2 slots, a 1-byte host
budget (every paged-out adapter spills to the volume) and a quota of two and a half
spilled pages (models spill as ticks page others in). The namespace's third spill stays
in host memory, its next registration is refused naming the quota until unloading a model
makes room again, and a neighbour namespace spills and registers within its own quota
meanwhile."""

from __future__ import annotations

from pathlib import Path

import pytest
from loraplex_engine.memory.spill import SpilledPage
from loraplex_engine.spec.errors import CheckpointQuotaError, NamespaceShareError
from loraplex_engine.spec.training_service import ClientLora, LossCall

from tests.support.client_driver import drive, sft_datum
from tests.support.engine_builders import engine, spec

A, B = "team-a", "team-b"
DATUM, CE = [sft_datum([1, 40, 41], [100, 101, 102])], LossCall("cross_entropy")


def _engine(model_dir: Path, root: Path, quota: int | None):
    return engine(
        model_dir, root, max_adapters=2, host_adapter_memory=1,
        client_models_per_namespace=16, checkpoint_quota_bytes=quota,
    )  # fmt: skip


def _create(eng, namespace: str, *ids: str) -> None:
    """Register each model and give it one call: registering past the slots only records
    it, so it is the call's tick that pages it in (and the least recently used model out,
    whose page then spills)."""
    for i, model_id in enumerate(ids):
        eng.clients.create_model(namespace, model_id, ClientLora(rank=4, seed=i))
        drive(eng, lambda m=model_id: eng.clients.forward_backward(namespace, m, DATUM, CE))


def _spilled(eng, namespace: str) -> list[str]:
    prefix = f"tinker:{namespace}/"
    return sorted(
        n.removeprefix(prefix)
        for n, p in eng.pager.pages.items()
        if isinstance(p, SpilledPage) and n.startswith(prefix)
    )


def _page_file_bytes(model_dir: Path, root: Path) -> int:
    eng = _engine(model_dir, root, None)
    try:
        _create(eng, A, "p0", "p1", "p2")  # p0 leaves its slot and spills
        (page,) = [p for p in eng.pager.pages.values() if isinstance(p, SpilledPage)]
        return page.disk_bytes
    finally:
        eng.close()


def test_spills_past_the_quota_stay_in_host_memory_and_stop_registration(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    page = _page_file_bytes(tiny_model_dir, tmp_path / "probe")
    quota = 2 * page + page // 2
    eng = _engine(tiny_model_dir, tmp_path / "ckpt", quota)
    try:
        _create(eng, A, "a0", "a1", "a2", "a3")  # a0, a1 leave their slots and spill
        assert _spilled(eng, A) == ["a0", "a1"]
        assert eng.store.quota.used(tmp_path / "ckpt", A) == 2 * page
        _create(eng, A, "a4")  # a2 leaves its slot: a third page does not fit the quota
        assert _spilled(eng, A) == ["a0", "a1"]
        assert eng.pager.is_paged("tinker:team-a/a2") and eng.pager.host_bytes() > 0
        with pytest.raises(CheckpointQuotaError, match="paged-out adapters spilled"):
            eng.store.quota.check(tmp_path / "ckpt", A, page)  # a checkpoint counts them too
        with pytest.raises(NamespaceShareError, match=f"checkpoint quota of {quota} bytes"):
            _create(eng, A, "a5")
        assert eng.clients.loaded(A, "a5") is None
        unload = eng.clients.unload_now
        unload(eng.clients.loaded(A, "a4"), save=False)  # a slot frees; a2 is still held
        with pytest.raises(NamespaceShareError):
            _create(eng, A, "a5")
        unload(eng.clients.loaded(A, "a0"), save=False)  # its spilled page goes: room again
        _create(eng, A, "a5")  # a2 spills first, then a5 registers
        assert _spilled(eng, A) == ["a1", "a2"] and eng.clients.loaded(A, "a5") is not None
        _create(eng, B, "b0", "b1", "b2", "b3")  # a3, a5 held; the neighbour spills b0, b1
        assert _spilled(eng, B) == ["b0", "b1"]
        assert eng.store.quota.used(tmp_path / "ckpt", B) == 2 * page
        with pytest.raises(NamespaceShareError):
            _create(eng, A, "a6")
        with pytest.raises(NamespaceShareError, match="checkpoint quota"):  # the other door
            eng.put_experiment(f"{A}.exp", spec(steps=1), A, "exp")
    finally:
        eng.close()


def test_a_ticks_spill_decision_never_walks_the_volume(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tick pages a0 back in, evicting a model whose page then spills: that decision
    reads the namespace's checkpoint bytes as last counted (registration walked them), so
    ``tree_bytes`` is not called on the tick's thread (counted by wrapping it)."""
    from loraplex_engine.store import quota as quota_module

    eng = _engine(tiny_model_dir, tmp_path / "ckpt", 1 << 30)
    try:
        _create(eng, A, "a0", "a1", "a2")  # a0 leaves its slot (and spills)
        walks: list[Path] = []
        real = quota_module.tree_bytes
        monkeypatch.setattr(quota_module, "tree_bytes", lambda p: walks.append(p) or real(p))
        spills = eng.pager.stats.spills
        drive(eng, lambda: eng.clients.forward_backward(A, "a0", DATUM, CE))
        assert eng.pager.stats.spills > spills  # the tick paged one out, and it spilled
        assert walks == []
    finally:
        eng.close()
