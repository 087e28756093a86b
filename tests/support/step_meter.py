"""A bystander tenant's pace on a live engine: its step and the engine's RSS, sampled
every 0.1 s while an attack runs, as a rate, the longest stall between steps and the
RSS's growth."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psutil

from tests.support.server_process import EngineServer
from tests.support.tenant_api import status

BYSTANDER = "team-b.bystander"


class Meter:
    """B's step and the engine's RSS every 0.1 s while running."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self.engine = psutil.Process(server.proc.pid if server.proc else 0)
        self.steps: list[tuple[float, int]] = []
        self.rss: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        with self.server.client() as c:
            while not self._stop.is_set():
                self.steps.append((time.monotonic(), status(c, BYSTANDER)["step"]))
                self.rss.append(self.engine.memory_info().rss)
                self._stop.wait(0.1)

    @contextmanager
    def running(self, min_s: float = 5.0) -> Iterator[Meter]:
        """Sample while the block runs, for ``min_s`` at least."""
        t0 = time.monotonic()
        self._thread.start()
        try:
            yield self
            self._stop.wait(max(0.0, min_s - (time.monotonic() - t0)))
        finally:
            self._stop.set()
            self._thread.join(10)

    def run(self, attack: Callable[[], None] = lambda: None, min_s: float = 5.0) -> Meter:
        """Sample while ``attack`` runs, for ``min_s`` at least."""
        with self.running(min_s):
            attack()
        return self

    @property
    def rate(self) -> float:
        (t0, s0), (t1, s1) = self.steps[0], self.steps[-1]
        return (s1 - s0) / (t1 - t0)

    @property
    def longest_stall(self) -> float:
        """Longest time between two samples that saw B's step change (or the ends)."""
        changes = [self.steps[0][0]]
        changes += [t for (_, prev), (t, s) in itertools.pairwise(self.steps) if s != prev]
        changes.append(self.steps[-1][0])
        return max(b - a for a, b in itertools.pairwise(changes))

    @property
    def rss_growth(self) -> int:
        """The engine's RSS: its peak over the first sample's, in bytes."""
        return max(self.rss) - self.rss[0]
