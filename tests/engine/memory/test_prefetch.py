"""Prefetch (memory/prefetch.py): after a tick's compute is issued, the client models
still queued are paged into slots the tick does not touch, on the copy stream, so the
next tick finds them resident. On a real Engine with the tiny model (CPU).

No CUDA stream can run here, so the device ordering is checked with a recording stream
in the pager's place (the one fake in this file, as in test_copy_stream.py): it logs each
``mark`` of the compute stream, each copy's slot and the mark it waits for, each wait,
and each tick's rows with the slots they read. Read as a device would run it, every
kernel logged before a mark has run once a copy that waits for that mark starts, and
nothing logged after it has. Prefetch on and off train bit for bit alike (on CPU the
copies are synchronous: this guards the code path, not the device's ordering)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from loraplex_engine.memory.copy_stream import CopyStats
from loraplex_engine.spec.training_service import AdamStep, ClientLora, LossCall

from tests.support.client_driver import NS, drive, sft_datum
from tests.support.engine_builders import engine

CE, ADAM = LossCall("cross_entropy"), AdamStep(learning_rate=0.01)
DATA = [sft_datum([1, 40 + i, 41], [100 + i, 101, 102]) for i in range(8)]
IDS = [f"m{i}" for i in range(6)]


class RecordingStream:
    """Logs marks, issues (slot, awaited mark), waits; the copies run inline (CPU)."""

    def __init__(self, pager: Any, log: list[tuple[Any, ...]]) -> None:
        self.stats, self.pager, self.log = CopyStats(), pager, log
        self._pending: set[str] = set()

    def mark(self) -> object:
        self.log.append(("mark", len(self.log)))
        return len(self.log) - 1  # the mark's own place in the log

    def sync(self) -> None:
        self.log.append(("sync",))

    @contextmanager
    def issue(self, name: str, after: object = None) -> Iterator[None]:
        yield
        self.log.append(("issue", name, self.pager.model.slot_of(name), after))
        self._pending.add(name)

    def wait(self, names: Iterable[str]) -> None:
        for name in names:
            if name in self._pending:
                self._pending.discard(name)
                self.log.append(("wait", name))

    def pending(self) -> frozenset[str]:
        return frozenset(self._pending)


def _engine(model_dir: Path, root: Path):
    # 4 slots, 2 models a tick: the other two slots are the prefetch's room.
    return engine(
        model_dir, root, max_adapters=4, client_models_per_tick=2, client_models_per_namespace=8
    )


def _round(eng, ids: list[str]) -> list[float]:
    outs = drive(
        eng,
        *(lambda i=i: eng.clients.forward_backward(NS, i, [DATA[IDS.index(i)]], CE) for i in ids),
        *(lambda i=i: eng.clients.optim_step(NS, i, ADAM) for i in ids),
    )
    return [o.metrics["loss:sum"] for o in outs[: len(ids)]]


def _create(eng, ids: list[str] = IDS) -> None:
    for n, i in enumerate(ids):
        eng.clients.create_model(NS, i, ClientLora(rank=4, seed=n))


def _record_runs(eng, log: list[tuple[Any, ...]]) -> None:
    real_run = eng._tick.run

    def run(*args, **kwargs):
        pager = eng.pager
        log.append(("run", frozenset(pager.busy), {pager.model.slot_of(n) for n in pager.busy}))
        return real_run(*args, **kwargs)

    eng._tick.run = run


def test_prefetched_copies_wait_for_their_slots_readers_and_run_before_their_rows(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    eng = _engine(tiny_model_dir, tmp_path)
    log: list[tuple[Any, ...]] = []
    eng.pager.copies = RecordingStream(eng.pager, log)
    _record_runs(eng, log)
    try:
        _create(eng)
        for ids in (IDS, IDS[::-1], IDS):
            _round(eng, ids)
        side = [e for e in log if e[0] == "issue" and e[3] is not None]
        assert side, "no copy waited for a mark only"
        unwaited: set[str] = set()
        for at, entry in enumerate(log):
            if entry[0] == "issue":
                unwaited.add(entry[1])
                _, name, slot, after = entry
                if after is None:
                    continue  # waits for everything queued on the compute stream
                readers = [e for e in log[:at] if e[0] == "run" and slot in e[2]]
                last = max((log.index(e) for e in readers), default=-1)
                assert last < after, f"{name}'s copy into slot {slot} may race a tick's rows"
            elif entry[0] == "wait":
                unwaited.discard(entry[1])
            elif entry[0] == "run":
                early = unwaited & entry[1]
                assert not early, f"rows of {sorted(early)} ran before their copies landed"
        stats = eng.pager.stats
        assert stats.prefetches >= 2 and stats.prefetch_hits >= 2, stats
    finally:
        eng.close()


def test_prefetch_on_and_off_train_bit_for_bit_alike(tiny_model_dir: Path, tmp_path: Path):
    results = []
    for limit in (None, 0):  # the slots, or no prefetch
        eng = _engine(tiny_model_dir, tmp_path / str(limit))
        eng.pager.prefetch_limit = limit
        try:
            _create(eng)
            losses = [_round(eng, ids) for ids in (IDS, IDS[2:], IDS[::-1], IDS[:3])]
            weights = {}
            for i in IDS:
                name = eng.clients.loaded(NS, i).name
                eng.pager.page_in(name)
                weights |= {f"{i}:{k}": v for k, v in eng.model.adapter_state_dict(name).items()}
            results.append((losses, weights, eng.pager.stats))
        finally:
            eng.close()
    (on_losses, on_weights, on), (off_losses, off_weights, off) = results
    assert on.prefetch_hits >= 2 and off.prefetches == 0
    assert on.prefetch_misses < off.prefetch_misses  # page-ins the ticks no longer made
    assert on_losses == off_losses
    assert on_weights.keys() == off_weights.keys()
    assert all(torch.equal(on_weights[k], off_weights[k]) for k in on_weights)


def test_prefetch_never_evicts_a_model_with_work_in_flight(tiny_model_dir: Path, tmp_path: Path):
    eng = _engine(tiny_model_dir, tmp_path)
    pager = eng.pager
    evicted: list[tuple[str, bool]] = []  # by a prefetch: (adapter, gradient held then)
    real_fill, real_out = pager.fill, pager.page_out
    prefetching = [False]

    def fill(name: str, wait: bool, side: bool = False, evict: str | None = None) -> int:
        prefetching[0] = side
        try:
            return real_fill(name, wait, side, evict)
        finally:
            prefetching[0] = False

    def page_out(name: str, spill_now: bool = True):
        if prefetching[0]:
            model = next(m for m in eng.clients._models.values() if m.name == name)
            evicted.append((name, model.grads is not None))
        return real_out(name, spill_now)

    pager.fill, pager.page_out = fill, page_out
    try:
        _create(eng)
        busy = eng.clients.loaded(NS, "m0").name
        # m0's forward_backward accumulates a gradient its optim_step has not taken yet.
        drive(eng, lambda: eng.clients.forward_backward(NS, "m0", [DATA[0]], CE))
        for ids in (IDS[1:], IDS[:0:-1]):
            _round(eng, ids)
        assert evicted, "no prefetch evicted anything: the test would prove nothing"
        assert (busy, True) not in evicted
        assert not any(held for _, held in evicted), evicted
        drive(eng, lambda: eng.clients.optim_step(NS, "m0", ADAM))
    finally:
        eng.close()
