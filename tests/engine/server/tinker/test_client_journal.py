"""A client experiment's journal (server/tinker/journal.py, issue 29 item 3): the operations an
engine accepted since the model's last checkpoint are replayed, under the same future
ids, by the engine that takes the experiment after a crash, so the client's futures
resolve there and training goes on as if nothing happened. Real Engines (the tiny
model) and the Tinker protocol in process; the crash is an engine dropped with
operations queued and not run."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from loraplex_engine.server.tinker.journal import Entry, Journal, find_future
from loraplex_engine.server.tinker.protocol import Protocol
from loraplex_engine.spec.experiment import parse_spec
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.support.engine_builders import engine

NS = "team-a"
MODEL = "s0123456789abcdef0123:train:0"
NAME = "tinker-s0123456789abcdef0123-0"
EXP = f"{NS}.{NAME}"
SPEC = parse_spec(
    {
        "lora": {"rank": 4},
        "client": {"modelId": MODEL, "seed": 1},
        "algorithm": {"maxSteps": 0},
        "checkpoint": {"everySteps": 1, "keep": 2},
    }
)


def fb(seq: int) -> bytes:
    tokens = [1, 40, 41, 42, 100, 101, 102, 103]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.array([0.0] * 3 + [1.0] * 4, dtype=np.float32),
        },
    )
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=MODEL,
        seq_id=seq,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


def optim(seq: int) -> dict[str, Any]:
    return {"model_id": MODEL, "seq_id": seq, "adam_params": {"learning_rate": 0.01}}


@contextmanager
def ticking(eng: Any) -> Iterator[None]:
    """The engine's loop, as `serve` runs it."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            if eng.tick() is None:
                time.sleep(0.002)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def wait_done(proto: Protocol, rid: str, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fut = find_future(proto, NS, rid)
        if fut is not None and fut.state in ("done", "failed"):
            assert fut.state == "done", fut.error
            return fut.result
        time.sleep(0.01)
    raise TimeoutError(rid)


def adapter(eng: Any) -> dict[str, torch.Tensor]:
    model = eng.clients.loaded(NS, MODEL)
    return {k: v.detach().clone() for k, v in eng.model.adapter_state_dict(model.name).items()}


@pytest.fixture()
def engines(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Any]:
    made: list[Any] = []

    def make(root: str) -> Any:
        made.append(engine(tiny_model_dir, tmp_path / root, max_adapters=2))
        return made[-1]

    yield make
    for e in made:
        e.close()


def test_an_engine_lost_with_operations_queued_is_replayed_where_the_model_resumes(
    engines: Any,
) -> None:
    # The reference: two steps, uninterrupted.
    ref = engines("ref")
    ref.put_experiment(EXP, SPEC, NS, NAME)
    p = Protocol(lambda: ref.clients)
    with ticking(ref):
        rids = [p.forward_backward(NS, fb(1), None), p.optim_step(NS, optim(2))]
        rids += [p.forward_backward(NS, fb(3), None), p.optim_step(NS, optim(4))]
        for rid in rids:
            wait_done(p, rid)
    p.close()
    want = adapter(ref)
    assert rids == [f"{MODEL}#{n}" for n in (1, 2, 3, 4)]  # the same on any engine

    # The first engine takes step 1 (checkpointed), then accepts step 2 and is lost
    # before it runs it.
    one = engines("shared")
    one.put_experiment(EXP, SPEC, NS, NAME)
    p1 = Protocol(lambda: one.clients)
    with ticking(one):
        wait_done(p1, p1.forward_backward(NS, fb(1), None))
        wait_done(p1, p1.optim_step(NS, optim(2)))
    p1.forward_backward(NS, fb(3), None)
    p1.optim_step(NS, optim(4))  # queued; no tick runs them
    p1.close()

    # The engine that takes the experiment resumes step 1 and replays the rest.
    two = engines("shared")
    status, _ = two.put_experiment(EXP, SPEC, NS, NAME)
    assert status.step == 1
    p2 = Protocol(lambda: two.clients)
    try:
        # Step 1's answer, had the client not read it before the crash: kept.
        kept = find_future(p2, NS, f"{MODEL}#2")
        assert kept.state == "done" and kept.result == wait_done(p1, f"{MODEL}#2")
        with ticking(two):
            result = wait_done(p2, f"{MODEL}#4")  # the client's future, asked again
            assert "metrics" in result
            assert wait_done(p2, f"{MODEL}#3")  # forward_backward's output, recomputed
        assert two.get_experiment(EXP).step == 2
        got = adapter(two)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
        journal = Journal(two.store.root / NS / "_tinker" / MODEL / "journal")
        assert journal.entries() == [] and journal.base() == (2, 4)
        assert journal.answer(2) is None and journal.answer(4) is not None  # the last window
    finally:
        p2.close()


def test_replay_lines_up_with_the_checkpoint_not_with_the_base(tmp_path: Path) -> None:
    """A crash between a checkpoint and the base's update: what the checkpoint holds is
    skipped, even though the base has not moved past it."""
    j = Journal(tmp_path)
    for seq, route in ((1, "forward_backward"), (2, "optim_step"), (3, "forward_backward")):
        j.write(Entry(seq, route, b"x"))
    j.write(Entry(4, "optim_step", b"{}"))
    assert [e.seq for e in j.to_replay(0)] == [1, 2, 3, 4]
    assert [e.seq for e in j.to_replay(1)] == [3, 4]  # step 1 written, base not updated
    assert j.to_replay(2) == []
    j.stepped(2, every=1)
    assert j.base() == (1, 2) and [e.seq for e in j.entries()] == [3, 4]
    assert [e.seq for e in j.to_replay(1)] == [3, 4]
    j.stepped(4, every=2)  # step 2: a checkpoint (every 2)
    assert j.base() == (2, 4) and j.entries() == []
    j.write(Entry(5, "optim_step", b"{}"))
    j.stepped(5, every=2)  # step 3: no checkpoint, so the entry stays
    assert j.base() == (2, 4) and [e.seq for e in j.entries()] == [5]
    assert j.to_replay(7) == []  # cannot be lined up: nothing replayed (logged)


def test_which_entries_a_checkpoint_holds(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    for seq, route in ((1, "forward_backward"), (2, "optim_step"), (3, "forward_backward")):
        j.write(Entry(seq, route, b"x"))
    assert j.held(2, 1).route == "optim_step" and j.held(1, 1).seq == 1
    assert j.held(3, 1) is None  # after the checkpoint's step: replayed, not held
    assert j.held(2, 0) is None  # the checkpoint before it: replayed
    assert j.held(2, 5) is None  # cannot be lined up: nothing claimed


def test_a_step_lost_between_its_checkpoint_and_its_answer_is_answered(engines: Any) -> None:
    """The window between a checkpoint's write and its answer's: the engine dies with
    step 1 on the volume but neither its kept answer nor the journal's move past it. The
    engine that takes over answers the step's future (applied; no metrics) instead of
    404, and replays nothing twice."""
    one = engines("shared")
    one.put_experiment(EXP, SPEC, NS, NAME)
    p1 = Protocol(lambda: one.clients)
    with ticking(one):
        wait_done(p1, p1.forward_backward(NS, fb(1), None))
        wait_done(p1, p1.optim_step(NS, optim(2)))
    p1.close()
    p1.runner._pool.shutdown(wait=True)  # its jobs' last writes (the kept answer) done
    journal = Journal(one.store.root / NS / "_tinker" / MODEL / "journal")
    (journal.dir / "2.done").unlink()  # the crash, undone on the volume: answer not kept,
    (journal.dir / "base.json").unlink()  # the base not moved, the entries not dropped
    journal.write(Entry(1, "forward_backward", fb(1)))
    journal.write(Entry(2, "optim_step", json.dumps(optim(2)).encode()))

    two = engines("shared")
    assert two.put_experiment(EXP, SPEC, NS, NAME)[0].step == 1
    p2 = Protocol(lambda: two.clients)
    try:
        fut = find_future(p2, NS, f"{MODEL}#2")
        assert fut is not None and fut.state == "done" and fut.result == {"metrics": {}}
        assert find_future(p2, NS, f"{MODEL}#1").state == "done"  # its kept answer
        assert two.get_experiment(EXP).step == 1  # nothing replayed
    finally:
        p2.close()
