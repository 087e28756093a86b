"""Soft-state back-offs of a pool's reconciler (pure: the clock is passed in or injected).

- `PutBackoff`: per experiment, binds an engine answered with a 5xx (its fault, not a
  lack of room) are retried after 5, 10, 20, 40 s, then the experiment fails;
- `RecreateBackoff`: per pool, failed engine pods (evicted, refused by the kubelet, lost
  with their node) are replaced as a kubelet restarts a crashing container: the first at
  once, then after 10 s doubling to 5 minutes while replacements keep failing; a pod that
  turns ready for the first time resets it. Without it a pool whose pods the kubelet
  fails at once got a new pod every round, for ever.

A restarted operator starts both again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from loraplex_operator.engine_failures import PodFailure

# An engine's 5xx to a PUT is its fault, not a lack of room (issue 26: a dataset that made
# every PUT answer 500 was retried as "no capacity" every round, for ever): the bind is
# retried after 5, 10, 20, 40 s, and after PUT_ATTEMPTS answers the experiment fails with
# the engine's error. A 503 (loading, or its loop stopped) waits for the engine instead.
PUT_ATTEMPTS = 5
PUT_BACKOFF_S = 5.0
PUT_BACKOFF_MAX_S = 300.0
WAIT_ENGINE_ERROR = "EngineError"


class PutBackoff:
    """Per experiment: how many binds an engine answered with a 5xx, and when the next
    may be tried (soft state: a restarted operator starts counting again)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._failed: dict[str, tuple[int, float]] = {}  # key -> (answers, next try)

    def waiting(self, key: str) -> bool:
        hit = self._failed.get(key)
        return hit is not None and self.clock() < hit[1]

    def failed(self, key: str) -> int:
        """Count one more 5xx; returns how many so far."""
        count = self._failed.get(key, (0, 0.0))[0] + 1
        delay = min(PUT_BACKOFF_S * 2 ** (count - 1), PUT_BACKOFF_MAX_S)
        self._failed[key] = (count, self.clock() + delay)
        return count

    def forget(self, key: str) -> None:
        self._failed.pop(key, None)

    def keep_only(self, keys: Collection[str]) -> None:
        """Drop the entries of experiments not in ``keys`` (deleted, or no longer bound)."""
        for key in [k for k in self._failed if k not in keys]:
            del self._failed[key]


RECREATE_BACKOFF_S = 10.0
RECREATE_BACKOFF_MAX_S = 300.0


def recreate_delay(failures: int) -> float:
    """Seconds before replacing the `failures`-th failed pod in a row (1-based)."""
    if failures <= 1:
        return 0.0
    return min(RECREATE_BACKOFF_S * 2 ** (failures - 2), RECREATE_BACKOFF_MAX_S)


@dataclass
class RecreateBackoff:
    """One pool's failed-pod replacements (see the module doc)."""

    failures: int = 0
    not_before: float = 0.0
    last: PodFailure | None = None
    counted: frozenset[str] = frozenset()  # failed pods already counted (still listed)
    ready: frozenset[str] = frozenset()  # pods ready last round

    def observe(self, failed: Iterable[PodFailure], ready: Iterable[str], now: float) -> None:
        """One round: the pool's failed pods (to be replaced) and its ready pods."""
        ready = frozenset(ready)
        fresh, self.ready = ready - self.ready, ready
        if fresh:  # an engine came up: the failures were not for ever
            self.failures, self.not_before, self.last = 0, 0.0, None
        failed = list(failed)
        new = [f for f in failed if f.pod not in self.counted]
        self.counted = frozenset(f.pod for f in failed)
        if new:
            self.failures += len(new)
            self.last = new[-1]
            self.not_before = now + recreate_delay(self.failures)

    def holding(self, now: float) -> PodFailure | None:
        """The failure that holds back new pods now, or None."""
        return self.last if self.last is not None and now < self.not_before else None
