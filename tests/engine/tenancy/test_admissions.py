"""One admission per experiment id (tenancy/admissions.py): the operator retries a PUT
that outlasts its 30-s timeout while the engine still reads the dataset; the retry must
wait for that admission, not start a second reader of the same dataset."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from loraplex_engine.tenancy.admissions import KeyedLocks

from tests.support.engine_builders import engine, spec

EXP = "team-a.big-data"
WAIT_S = 30.0  # bounds a wait for another thread's progress; never reached when it works


def _wait_for(cond: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, "the other thread made no progress"
        time.sleep(0.005)


def test_a_key_is_held_by_one_thread_at_a_time_and_forgotten_after() -> None:
    locks, order = KeyedLocks(), []
    first_in = threading.Event()
    release = threading.Event()

    def first() -> None:
        with locks.hold("a"):
            first_in.set()
            release.wait(WAIT_S)
            order.append("first")

    def second() -> None:
        with locks.hold("a"):
            order.append("second")

    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(first)
        assert first_in.wait(WAIT_S)
        b = pool.submit(second)
        _wait_for(lambda: locks.users("a") == 2)
        with locks.hold("b"):  # another key is not held up
            assert order == []
        release.set()
        a.result(WAIT_S), b.result(WAIT_S)
    assert order == ["first", "second"]
    assert len(locks) == 0 and locks.users("a") == 0


def test_a_retried_put_waits_for_the_admission_in_flight(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "say yes", "answer": "yes"}\n' * 8)
    eng = engine(tiny_model_dir, tmp_path / "ckpt")
    build, builds, go = eng._build, [], threading.Event()

    def slow_build(*args: Any, **kwargs: Any) -> Any:  # the dataset read that takes minutes
        builds.append(args[0])
        go.wait(WAIT_S)
        return build(*args, **kwargs)

    eng._build = slow_build
    experiment = spec({"name": "jsonl", "dataset": str(data)}, steps=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(eng.put_experiment, EXP, experiment, "team-a", "big-data")
            _wait_for(lambda: builds == [EXP])
            retry = pool.submit(eng.put_experiment, EXP, experiment, "team-a", "big-data")
            _wait_for(lambda: eng.admissions.users(EXP) == 2)  # the retry waits its turn
            go.set()
            (_, created), (again, created_again) = first.result(WAIT_S), retry.result(WAIT_S)
        assert builds == [EXP], "the retry started a second admission"
        assert created and not created_again and again.id == EXP
        assert len(eng.admissions) == 0
    finally:
        eng.close()
