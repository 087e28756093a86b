"""One tracker's queue and the thread that drains it, so that a tracker that is slow or
down costs the training loop nothing.

The loop only appends (:meth:`Sink.put`: a bounded deque, the oldest records dropped and
counted when it is full; never a wait). The sink's own thread sends batches to the
tracker; a batch that fails is kept at the front and retried after a backoff that doubles
up to a cap, while new records queue behind it. Errors are counted and logged at most
once a minute (with how many were not logged), and the recovery once. The policies
(:func:`backoff_s`, :class:`LogLimiter`) are pure and tested directly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from loraplex_engine.tracking.records import StepRecord

log = logging.getLogger("loraplex_engine.tracking")

BATCH = 200  # records per call to a tracker
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 60.0
LOG_EVERY_S = 60.0


class Tracker(Protocol):
    """A destination of step records. ``log`` raises on failure (the sink retries the
    same batch); ``close`` ends what the tracker holds open (files, runs)."""

    name: str

    def log(self, records: Sequence[StepRecord]) -> None: ...

    def close(self) -> None: ...


class SinkEvents(Protocol):
    """What a sink reports (the Prometheus series, tracking/hub.py)."""

    def sent(self, tracker: str, n: int) -> None: ...

    def dropped(self, tracker: str, n: int) -> None: ...

    def failed(self, tracker: str) -> None: ...

    def up(self, tracker: str, ok: bool) -> None: ...


def backoff_s(failures: int, base: float = BACKOFF_BASE_S, cap: float = BACKOFF_CAP_S) -> float:
    """Wait before retry number ``failures`` (1, 2, ...): base, 2·base, 4·base, ... ≤ cap."""
    if failures <= 0:
        return 0.0
    return min(cap, base * 2 ** min(failures - 1, 32))


@dataclass
class LogLimiter:
    """At most one log line per ``every_s``; counts the ones it held back."""

    every_s: float = LOG_EVERY_S
    last: float | None = None
    held: int = 0

    def allow(self, now: float) -> tuple[bool, int]:
        """(log now?, lines held back since the last one logged)."""
        if self.last is not None and now - self.last < self.every_s:
            self.held += 1
            return False, 0
        held, self.held, self.last = self.held, 0, now
        return True, held


class Sink:
    """A bounded queue in front of one tracker, drained by its own daemon thread."""

    def __init__(
        self,
        tracker: Tracker,
        events: SinkEvents,
        capacity: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        backoff: Callable[[int], float] = backoff_s,
    ) -> None:
        self.tracker = tracker
        self.events = events
        self.capacity = capacity
        self.clock = clock
        self.backoff = backoff
        self._queue: deque[StepRecord] = deque()
        self._lock = threading.Lock()
        self._ready = threading.Event()  # records queued, or stopping
        self._stop = threading.Event()
        self.failures = 0  # in a row
        self._limiter = LogLimiter()
        self._thread = threading.Thread(
            target=self._run, name=f"tracking-{tracker.name}", daemon=True
        )
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def put(self, records: Sequence[StepRecord]) -> None:
        """Queue ``records``; never blocks (past capacity the oldest are dropped)."""
        if not records:
            return
        with self._lock:
            self._queue.extend(records)
            over = len(self._queue) - self.capacity
            for _ in range(max(0, over)):
                self._queue.popleft()
        if over > 0:
            self.events.dropped(self.tracker.name, over)
        self._ready.set()

    def close(self, timeout: float) -> bool:
        """Send what is queued (one try, no backoff), close the tracker, within
        ``timeout`` seconds; False when the thread did not finish in time (what is left
        is abandoned with the daemon thread)."""
        self._stop.set()
        self._ready.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "tracking: %s did not finish within %.0fs; %d step records not sent",
                self.tracker.name,
                timeout,
                self.queued,
            )
            return False
        return True

    def _take(self) -> list[StepRecord]:
        with self._lock:
            n = min(BATCH, len(self._queue))
            return [self._queue.popleft() for _ in range(n)]

    def _give_back(self, batch: list[StepRecord]) -> None:
        """A failed batch goes back to the front, as far as the queue has room."""
        with self._lock:
            room = max(0, self.capacity - len(self._queue))
            kept = batch[len(batch) - room :] if room < len(batch) else batch
            self._queue.extendleft(reversed(kept))
        if len(kept) < len(batch):
            self.events.dropped(self.tracker.name, len(batch) - len(kept))

    def _run(self) -> None:
        while True:
            self._ready.wait()
            stopping = self._stop.is_set()
            batch = self._take()
            if not batch:
                if stopping:
                    break
                self._ready.clear()
                if self.queued:  # put() raced the clear
                    self._ready.set()
                continue
            if self._send(batch) or stopping:
                if stopping and self.failures:
                    break  # down at shutdown: one try was all it had
                continue
            self._give_back(batch)
            self._stop.wait(self.backoff(self.failures))
        self._close_tracker()

    def _send(self, batch: list[StepRecord]) -> bool:
        try:
            self.tracker.log(batch)
        except Exception as e:
            self.failures += 1
            self.events.failed(self.tracker.name)
            self.events.up(self.tracker.name, False)
            now_log, held = self._limiter.allow(self.clock())
            if now_log:
                log.warning(
                    "tracking: %s failed (%d in a row, %d similar lines held back); "
                    "retrying in %.0fs, training goes on: %s: %s",
                    self.tracker.name,
                    self.failures,
                    held,
                    self.backoff(self.failures),
                    type(e).__name__,
                    " ".join(str(e).split())[:300],
                )
            return False
        if self.failures:
            log.info("tracking: %s recovered after %d failures", self.tracker.name, self.failures)
        self.failures = 0
        self.events.sent(self.tracker.name, len(batch))
        self.events.up(self.tracker.name, True)
        return True

    def _close_tracker(self) -> None:
        try:
            self.tracker.close()
        except Exception:
            log.warning("tracking: closing %s failed", self.tracker.name, exc_info=True)
