"""Sampling sessions' completion queues (``/retrieve_futures``) and sample cancellation
(``/cancel_future``), as the tinker SDK's ``SessionFuturesPoller`` and its cancel drain
use them.

- A sample sent on a sampling session (``sampling_session_id`` + ``seq_id``) belongs to
  the target ``(session, cloned sampler = seq_id // 1e9)``. When its future reaches its
  final state (answered, failed or cancelled) the target's queue gets a completion with
  the next cursor.
- A poll names its target and ``prev_cursor``: completions at or before it are seen and
  dropped; it answers the newer ones at once, or waits (``timeout``, at most
  ``MAX_WAIT_S``) for one. ``retrieved_request_ids`` are the target's requests whose
  answers the client holds: their futures are dropped after the table's grace.
- Everything is keyed by namespace: a target or request id of another namespace is
  another queue or no future at all (404), never a different answer.
- A queue holds at most ``max_queued`` unacknowledged completions (the oldest go first;
  their futures still answer ``retrieve_future``), and is dropped once empty and unpolled;
  cursors are shared by all queues, so one made again continues past every old cursor.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from loraplex_engine.server.tinker.future_table import FutureTable
from loraplex_engine.server.tinker.futures import Future
from loraplex_engine.spec.errors import InvalidRequestError, NotFoundError
from loraplex_engine.spec.tinker_limits import FUTURES_PER_NAMESPACE

CLONE_BLOCK = 1_000_000_000  # the SDK's seq_id block per cloned sampling client
MAX_WAIT_S = 30.0  # the SDK's poll times out at 45 s; it expects about 30
CANCELLED = "cancelled by its client (cancel_future)"


@dataclass(frozen=True)
class Target:
    namespace: str
    sampling_session_id: str
    cloned_sampler_id: int


@dataclass(frozen=True)
class Completion:
    cursor: int
    request_id: str
    state: str  # "finished" | "failed", the SDK's FutureCompletion.state

    def answer(self) -> dict[str, object]:
        return {"state": self.state, "request_id": self.request_id}


@dataclass
class _Queue:
    items: list[Completion] = field(default_factory=list)
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=list)


@dataclass(frozen=True)
class Poll:
    """One checked ``FuturesRetrieveRequest``."""

    target: Target
    prev_cursor: int
    wait_s: float
    retrieved: tuple[str, ...]


def target_of(namespace: str, body: dict[str, object]) -> Target | None:
    """A sample's target: its sampling session and clone (None: sent without one)."""
    session, seq = body.get("sampling_session_id"), body.get("seq_id")
    if not isinstance(session, str) or not session or not isinstance(seq, int):
        return None
    return Target(namespace, session, seq // CLONE_BLOCK)


def read_poll(namespace: str, body: dict[str, object], default_wait_s: float) -> Poll:
    """The poll's fields checked, each refusal naming its field."""
    target = body.get("target")
    if not isinstance(target, dict) or target.get("type", "sampling_session") != (
        "sampling_session"
    ):
        raise InvalidRequestError("a sampling_session target is required", field="target")
    session = target.get("sampling_session_id")
    if not isinstance(session, str) or not session:
        raise InvalidRequestError("required", field="target.sampling_session_id")
    clone = target.get("cloned_sampler_id", 0)
    if isinstance(clone, bool) or not isinstance(clone, int) or clone < 0:
        raise InvalidRequestError("a non-negative integer", field="target.cloned_sampler_id")
    prev = body.get("prev_cursor", 0)
    if isinstance(prev, bool) or not isinstance(prev, int) or prev < 0:
        raise InvalidRequestError("a non-negative integer", field="prev_cursor")
    wait = body.get("timeout")
    if wait is None:
        wait = default_wait_s
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not math.isfinite(wait):
        raise InvalidRequestError("a finite number of seconds", field="timeout")
    if wait < 0:
        raise InvalidRequestError("must be >= 0", field="timeout")
    ids = body.get("retrieved_request_ids") or []
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise InvalidRequestError("a list of request ids", field="retrieved_request_ids")
    if len(ids) > FUTURES_PER_NAMESPACE:
        raise InvalidRequestError(
            f"at most {FUTURES_PER_NAMESPACE} ids", field="retrieved_request_ids"
        )
    return Poll(Target(namespace, session, clone), prev, min(float(wait), MAX_WAIT_S), tuple(ids))


class Completions:
    def __init__(self, futures: FutureTable, max_queued: int = FUTURES_PER_NAMESPACE) -> None:
        self.futures = futures
        self.max_queued = max_queued
        self._lock = threading.Lock()
        self._queues: dict[Target, _Queue] = {}
        # One cursor for every queue, so a queue dropped when empty and made again
        # never hands out a cursor its poller has already passed.
        self._cursor = itertools.count(1)
        # namespace -> request id -> its target, for cancel_future (bounded as the queues)
        self._targets: dict[str, OrderedDict[str, Target]] = {}

    # --- the sample's side ---

    def tracked(
        self, fut: Future, target: Target | None, job: Callable[[], None]
    ) -> Callable[[], None]:
        """``job`` (which finishes ``fut``) as run for a sample: skipped when cancelled
        before it started; its completion queued on ``target`` once final."""
        if target is not None:
            with self._lock:
                known = self._targets.setdefault(target.namespace, OrderedDict())
                known[fut.request_id] = target
                while len(known) > self.max_queued:
                    known.popitem(last=False)

        def run() -> None:
            if fut.state == "failed":  # cancelled while it waited for a worker
                return
            try:
                job()
            finally:
                self.complete(fut)

        return run

    def complete(self, fut: Future) -> None:
        with self._lock:
            target = self._targets.get(fut.namespace, {}).get(fut.request_id)
            if target is None or fut.state not in ("done", "failed"):
                return
            queue = self._queues.setdefault(target, _Queue())
            state = "finished" if fut.state == "done" else "failed"
            queue.items.append(Completion(next(self._cursor), fut.request_id, state))
            del queue.items[: -self.max_queued]
            self._targets[fut.namespace].pop(fut.request_id, None)
            waiters, queue.waiters = queue.waiters, []
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # its loop has closed
                loop.call_soon_threadsafe(event.set)

    def cancel(self, namespace: str, request_id: str) -> None:
        """Fail a pending sample as cancelled (a finished one stays as it is); an id of
        another namespace, or none, is 404; a training call cannot be cancelled (422)."""
        fut = self.futures.get(namespace, request_id)
        if fut is None:
            raise NotFoundError(
                f"no request {request_id!r} (unknown, or its result has expired)",
                field="request_id",
            )
        if fut.kind != "Sample":
            raise InvalidRequestError(
                f"only sampling requests can be cancelled, not {fut.kind}", field="request_id"
            )
        if fut.state in ("pending", "paused_capacity"):
            fut.fail(CANCELLED, "user")
            fut.cancelled = True  # an answer arriving later is dropped
            self.complete(fut)

    # --- the poller's side ---

    async def poll(self, poll: Poll) -> dict[str, object]:
        self._acknowledge(poll)
        event = asyncio.Event()
        with self._lock:
            found = self._newer(poll)
            if found is None and poll.wait_s > 0:
                queue = self._queues.setdefault(poll.target, _Queue())
                queue.waiters.append((asyncio.get_running_loop(), event))
        if found is None and poll.wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), poll.wait_s)
            with self._lock:
                found = self._newer(poll)
                queue = self._queues.get(poll.target)
                if queue is not None:
                    queue.waiters = [w for w in queue.waiters if w[1] is not event]
                    self._drop_if_idle(poll.target, queue)
        items = found or []
        cursor = max([poll.prev_cursor, *(c.cursor for c in items)])
        return {"completions": [c.answer() for c in items], "cursor": cursor}

    def _acknowledge(self, poll: Poll) -> None:
        for rid in poll.retrieved:
            fut = self.futures.get(poll.target.namespace, rid)
            if fut is not None:
                self.futures.retrieved(fut)  # dropped after the table's grace
        with self._lock:
            queue = self._queues.get(poll.target)
            if queue is not None:
                queue.items = [c for c in queue.items if c.cursor > poll.prev_cursor]
                self._drop_if_idle(poll.target, queue)

    def _newer(self, poll: Poll) -> list[Completion] | None:
        queue = self._queues.get(poll.target)
        items = [] if queue is None else [c for c in queue.items if c.cursor > poll.prev_cursor]
        return items or None

    def _drop_if_idle(self, target: Target, queue: _Queue) -> None:
        if not queue.items and not queue.waiters:
            self._queues.pop(target, None)

    def queued(self) -> Iterable[Target]:
        with self._lock:
            return list(self._queues)
