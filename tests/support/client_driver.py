"""Driving client-model calls on a real Engine in tests: calls block until a tick answers
them, so they run on worker threads while the test ticks the engine."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from loraplex_engine.engine import Engine
from loraplex_engine.spec.training_service import ClientDatum

NS = "team-a"


def queued(eng: Engine) -> int:
    """Calls queued: through the registry's index of queued models (clients/line.py), so a
    bench with 10,000 idle models does not time this walk."""
    clients = eng.clients
    with clients._lock:
        return sum(len(m.queue) for m in clients._line.waiting()) + len(clients._samples)


def drive(eng: Engine, *calls: Callable[[], Any], timeout: float = 120.0) -> list[Any]:
    """Queue every call (all before the first tick, so different models share it), then
    tick until each is answered; their results in order (an error is raised, a tick's
    error too: the calls still queued are then refused, so nothing waits on them)."""
    with ThreadPoolExecutor(max(1, len(calls))) as pool:
        futures: list[Future[Any]] = []
        for call in calls:
            before = queued(eng)
            futures.append(pool.submit(call))
            deadline = time.monotonic() + timeout
            while queued(eng) <= before and not futures[-1].done():
                if time.monotonic() > deadline:
                    raise TimeoutError("a call was never queued")
                time.sleep(0.001)
        deadline = time.monotonic() + timeout
        while not all(f.done() for f in futures):
            try:
                ticked = eng.tick()
            except BaseException as e:
                # The calls no tick took would wait forever (and the pool for them):
                # answer them, as an engine whose tick loop died does, then raise.
                eng.clients.refuse(f"the tick failed: {type(e).__name__}")
                raise
            if ticked is None:
                time.sleep(0.001)
            if time.monotonic() > deadline:
                raise TimeoutError("calls still unanswered")
        return [f.result() for f in futures]


def sft_datum(prompt: list[int], completion: list[int]) -> ClientDatum:
    """Next-token training on ``completion`` after ``prompt`` (the SDK's usual datum)."""
    seq = prompt + completion
    weights = np.array([0.0] * (len(prompt) - 1) + [1.0] * len(completion), dtype=np.float32)
    return ClientDatum(
        seq[:-1], {"target_tokens": np.array(seq[1:], dtype=np.int64), "weights": weights}
    )
