"""Page-in copies on a side stream (memory/copy_stream.py), on a real Engine with the tiny
model (CPU). No CUDA stream can run here, so the ordering is checked with a recording
stream in the pager's place (the one fake in this file): every adapter a tick pages in
has its copies waited on before the tick's first row runs. And the results are bit for
bit the same with the tick's page-ins waited at the rows (overlap on) or each at once
(off); on CPU both run the same synchronous copies, so this guards the code path, not
the device's ordering (the GPU run does: docs/design/paging.md)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from loraplex_engine.memory.copy_stream import CopyStats, InlineStream, SideStream, for_device
from loraplex_engine.spec.training_service import AdamStep, ClientLora, LossCall

from tests.support.client_driver import NS, drive, sft_datum
from tests.support.engine_builders import engine

CE, ADAM = LossCall("cross_entropy"), AdamStep(learning_rate=0.01)
DATA = [sft_datum([1, 40 + i, 41], [100 + i, 101, 102]) for i in range(5)]


class RecordingStream:
    """Records issue / wait / nothing pending; the copies themselves run inline (CPU)."""

    def __init__(self, log: list[tuple[str, str]]) -> None:
        self.stats, self.log, self._pending = CopyStats(), log, set[str]()

    @contextmanager
    def issue(self, name: str, after: object = None) -> Iterator[None]:
        yield
        self.log.append(("issue", name))
        self._pending.add(name)

    def mark(self) -> object:
        return None

    def sync(self) -> None:
        return None

    def wait(self, names: Iterable[str]) -> None:
        for name in names:
            if name in self._pending:
                self._pending.discard(name)
                self.log.append(("wait", name))

    def pending(self) -> frozenset[str]:
        return frozenset(self._pending)


def _engine(model_dir: Path, root: Path):
    return engine(model_dir, root, max_adapters=2, client_models_per_namespace=8)


def _rounds(eng, ids: list[str], rounds: int = 3) -> list[list[float]]:
    for n, i in enumerate(ids):
        eng.clients.create_model(NS, i, ClientLora(rank=4, seed=n))
    losses = []
    for _ in range(rounds):
        outs = drive(
            eng,
            *(lambda n=n, i=i: eng.clients.forward_backward(NS, i, [DATA[n]], CE)
              for n, i in enumerate(ids)),
            *(lambda i=i: eng.clients.optim_step(NS, i, ADAM) for i in ids),
        )  # fmt: skip
        losses.append([o.metrics["loss:sum"] for o in outs[: len(ids)]])
    return losses


def test_no_row_runs_before_its_adapters_copies_are_waited_on(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    eng = _engine(tiny_model_dir, tmp_path)
    log: list[tuple[str, str]] = []
    eng.pager.copies = RecordingStream(log)
    real_run = eng._tick.run

    def run(*args, **kwargs):
        log.append(("run", ""))
        return real_run(*args, **kwargs)

    eng._tick.run = run
    try:
        _rounds(eng, ["m0", "m1", "m2", "m3"])
        issued = [name for kind, name in log if kind == "issue"]
        assert len(issued) >= 4  # the ticks paged models in (4 models, 2 slots)
        unwaited: set[str] = set()
        for kind, name in log:
            if kind == "issue":
                unwaited.add(name)
            elif kind == "wait":
                unwaited.discard(name)
            else:
                assert not unwaited, f"rows ran before the copies of {sorted(unwaited)}"
        assert eng.pager.copies.pending() == frozenset()
    finally:
        eng.close()


def test_overlap_on_and_off_train_bit_for_bit_alike(tiny_model_dir: Path, tmp_path: Path):
    results = []
    for overlap in (True, False):
        eng = _engine(tiny_model_dir, tmp_path / str(overlap))
        eng.pager.overlap = overlap
        try:
            ids = ["m0", "m1", "m2"]
            losses = _rounds(eng, ids)
            weights = {}
            for i in ids:
                name = eng.clients.loaded(NS, i).name
                eng.pager.page_in(name)
                weights |= {f"{i}:{k}": v for k, v in eng.model.adapter_state_dict(name).items()}
            assert eng.pager.stats.page_ins >= 2
            results.append((losses, weights))
        finally:
            eng.close()
    (on_losses, on_weights), (off_losses, off_weights) = results
    assert on_losses == off_losses
    assert on_weights.keys() == off_weights.keys()
    assert all(torch.equal(on_weights[k], off_weights[k]) for k in on_weights)


def test_cpu_copies_are_inline() -> None:
    stream = for_device(torch.device("cpu"))
    assert isinstance(stream, InlineStream)
    with stream.issue("a"):
        pass
    assert stream.pending() == frozenset() and stream.stats.issued == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA side stream")
def test_a_side_stream_copy_is_seen_once_waited_on() -> None:
    device = torch.device("cuda")
    stream = for_device(device)
    assert isinstance(stream, SideStream)
    slot = torch.zeros(1 << 20, device=device)
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    with stream.issue("a"):
        slot.copy_(host, non_blocking=True)
    assert stream.pending() == frozenset({"a"})
    stream.wait(["a"])
    assert torch.equal(slot.cpu(), host) and stream.pending() == frozenset()
    assert stream.stats.hidden + stream.stats.exposed == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA side stream")
def test_a_side_stream_copy_after_a_mark_is_seen_once_waited_on() -> None:
    device = torch.device("cuda")
    stream = for_device(device)
    slot = torch.zeros(1 << 20, device=device)
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    start = stream.mark()  # a prefetch waits for this point only, not later kernels
    busy = torch.randn(2048, 2048, device=device)
    for _ in range(8):
        busy = busy @ busy / 2048  # the "running tick": queued after the mark
    with stream.issue("a", start):
        slot.copy_(host, non_blocking=True)
    stream.wait(["a"])
    assert torch.equal(slot.cpu(), host) and stream.pending() == frozenset()
