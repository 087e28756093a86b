"""Futures: what a long-running Tinker call answers at once (``{"request_id"}``), and the
worker threads that run the engine call behind it.

- **The table** (future_table.py) is bounded per namespace and in memory (a restart
  forgets it). A future belongs to the namespace that created it; another namespace
  polling its id gets 404, as for an id that never existed.
- **Lanes**: the operations of one model run one after another, in the order of the
  SDK's ``seq_id`` (then of arrival), on a shared pool of worker threads, since an
  engine call blocks until the tick that serves it. Different models run at once, so
  their calls can share a tick. A *pipelined* job (a call the engine queues on the
  model in call order: forward, forward_backward, optim_step) hands the lane on as soon
  as the engine has queued it (its ``release``), while it still waits for its answer:
  the SDK's ``forward_backward`` then ``optim_step`` reach the engine together and
  share one tick, as Tinker's clock cycle has them.
- **Parked jobs**: a job that found the engine full (``NoCapacityError``) is parked and
  retried every ``retry_s`` seconds or as soon as a slot frees (:meth:`Runner.wake`);
  meanwhile its future reports the SDK's queue state ``paused_capacity``.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
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
# A pipelined job: called with ``release``, which it calls once the lane's next job may
# start (the engine queued its call); it may call it from any thread, at most once counts.
PipelinedJob = Callable[[Callable[[], None]], None]


@dataclass
class _Lane:
    queue: list[tuple[float, int, Job | PipelinedJob, bool]] = field(default_factory=list)
    running: bool = False


class Runner:
    """Per-model lanes on a shared thread pool, and the parked jobs' retries."""

    def __init__(self, workers: int = WORKERS, retry_s: float = CAPACITY_RETRY_S) -> None:
        self.retry_s = retry_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tinker")
        self._lock = threading.Lock()
        self._lanes: dict[str, _Lane] = {}
        self._count = itertools.count()
        self._parked: list[tuple[str, float, Job]] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._retry_loop, name="tinker-park", daemon=True)
        self._thread.start()

    def run(self, lane: str, job: Job, order: float | None = None) -> None:
        """Queue ``job`` on ``lane``; jobs of one lane run one at a time, lowest
        ``order`` (the SDK's seq_id) first, then first come."""
        self._push(lane, (_order(order), next(self._count), job, False))

    def run_pipelined(self, lane: str, job: PipelinedJob, order: float | None = None) -> None:
        """Like :meth:`run`, but the lane's next job starts once ``job`` calls its
        ``release`` argument (or returns), not only once it returns."""
        self._push(lane, (_order(order), next(self._count), job, True))

    def _push(self, lane: str, key: tuple[float, int, Job | PipelinedJob, bool]) -> None:
        with self._lock:
            entry = self._lanes.setdefault(lane, _Lane())
            heapq.heappush(entry.queue, key)
            if entry.running:
                return
            entry.running = True
        self._pool.submit(self._drain, lane)

    def submit(self, job: Job) -> None:
        """Run ``job`` on the pool, in no lane."""
        self._pool.submit(self._guarded, job)

    def park(self, lane: str, job: Job) -> None:
        """Run ``job`` on ``lane`` again after ``retry_s``, or at the next :meth:`wake`."""
        with self._lock:
            self._parked.append((lane, time.monotonic() + self.retry_s, job))

    def wake(self) -> None:
        """Something freed capacity: retry the parked jobs now."""
        with self._lock:
            self._parked = [(lane, 0.0, job) for lane, _, job in self._parked]
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

    def _drain(self, lane: str) -> None:
        while True:
            with self._lock:
                entry = self._lanes[lane]
                if not entry.queue:
                    entry.running = False
                    del self._lanes[lane]
                    return
                _, _, job, pipelined = heapq.heappop(entry.queue)
            if not pipelined:
                self._guarded(job)
                continue
            handed = threading.Event()

            def release(lane: str = lane, handed: threading.Event = handed) -> None:
                with self._lock:
                    if handed.is_set():
                        return
                    handed.set()
                self._pool.submit(self._drain, lane)  # the lane goes on without this thread

            self._guarded(lambda job=job, release=release: job(release))
            with self._lock:
                if not handed.is_set():  # never queued (refused at once): go on here
                    handed.set()
                    continue
            return

    def _retry_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(min(self.retry_s, 0.25))
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                due = [p for p in self._parked if p[1] <= now]
                self._parked = [p for p in self._parked if p[1] > now]
            for lane, _, job in due:
                self.run(lane, job)


def _order(order: float | None) -> float:
    return float("inf") if order is None else float(order)
