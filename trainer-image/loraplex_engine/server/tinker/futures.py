"""Futures: what a long-running Tinker call answers at once (``{"request_id"}``), and the
worker threads that wait for the engine behind it.

- **The table** (future_table.py) is bounded per namespace and in memory (a restart
  forgets it). A future belongs to the namespace that created it; another namespace
  polling its id gets 404, as for an id that never existed.
- **No order here**: a model's calls are ordered by one queue, the engine's
  (``TrainingService.submit``, by the SDK's ``seq_id``), which the protocol puts each
  call on before answering its request. The pool's threads only wait: for an answer
  (an engine call blocks until the tick that serves it), or on a blocking call that is
  no model's (create, sample).
- **Parked jobs**: a job that found the engine full (``NoCapacityError``) is parked and
  retried every ``retry_s`` seconds or as soon as a slot frees (:meth:`Runner.wake`);
  meanwhile its future reports the SDK's queue state ``paused_capacity``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

log = logging.getLogger("loraplex_engine.server.tinker.futures")

WORKERS = 64
CAPACITY_RETRY_S = 1.0

State = Literal["pending", "paused_capacity", "done", "failed"]
Category = Literal["user", "server", "unknown"]


@dataclass
class Future:
    request_id: str
    namespace: str
    kind: str  # ForwardBackward, OptimStep, ...: what the result is
    created: float = field(default_factory=time.monotonic)
    state: State = "pending"
    result: Any = None  # the encoded answer (bytes of protobuf, or a JSON dict)
    error: str | None = None
    category: Category = "user"
    finished: float | None = None
    retrieved: float | None = None  # when its client was answered its final state
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None
    cancelled: bool = False  # its client cancelled it: the answer stays the failure
    _waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(
        default_factory=list, repr=False
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def finish(self, result: Any) -> None:
        if self.cancelled:
            return
        self.result = result
        self.finished = time.monotonic()
        self._set("done")

    def fail(self, message: str, category: Category = "user") -> None:
        if self.cancelled:
            return
        self.error = message
        self.category = category
        self.finished = time.monotonic()
        self._set("failed")

    def set_state(self, state: State) -> None:
        if self.state != state:
            self._set(state)

    def _set(self, state: State) -> None:
        with self._lock:
            self.state = state
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:  # a poll waiting on this future answers now
            with contextlib.suppress(RuntimeError):  # its loop has closed
                loop.call_soon_threadsafe(event.set)

    async def changed(self, state: State, timeout: float) -> None:
        """Wait (at most ``timeout``) until the state is no longer ``state``."""
        event = asyncio.Event()
        with self._lock:
            if self.state != state:
                return
            self._waiters.append((asyncio.get_running_loop(), event))
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            with self._lock:
                self._waiters = [w for w in self._waiters if w[1] is not event]


Job = Callable[[], None]


class Runner:
    """A shared thread pool for jobs that block, and the parked jobs' retries."""

    def __init__(self, workers: int = WORKERS, retry_s: float = CAPACITY_RETRY_S) -> None:
        self.retry_s = retry_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tinker")
        self._lock = threading.Lock()
        self._parked: list[tuple[float, Job]] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._retry_loop, name="tinker-park", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Run ``job`` on the pool."""
        self._pool.submit(self._guarded, job)

    def park(self, job: Job) -> None:
        """Run ``job`` again after ``retry_s``, or at the next :meth:`wake`."""
        with self._lock:
            self._parked.append((time.monotonic() + self.retry_s, job))

    def wake(self) -> None:
        """Something freed capacity: retry the parked jobs now."""
        with self._lock:
            self._parked = [(0.0, job) for _, job in self._parked]
        self._wake.set()

    def parked(self) -> int:
        return len(self._parked)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _guarded(job: Job) -> None:
        try:
            job()
        except Exception:  # a job reports its own errors on its future
            log.exception("tinker job failed")

    def _retry_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(min(self.retry_s, 0.25))
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                due = [job for at, job in self._parked if at <= now]
                self._parked = [p for p in self._parked if p[0] > now]
            for job in due:
                self.submit(job)
