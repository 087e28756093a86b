"""The futures table: every future a long-running Tinker call answered, until its client
has it (``retrieve_future``) or it has waited too long.

Bounded per namespace, so one tenant can neither fill the table for the others nor
(at full speed) for itself:

- keyed by (namespace, request id): a request id another namespace chose, a client
  experiment's ``<model id>#<seq_id>`` included, names a different future;
- a future retrieved in its final state is dropped ``grace_s`` after (the SDK asks once,
  and again only when the answer was lost on the way: after its 45 s read timeout it retries
  after 1, 2, 4, 8 s), and one never retrieved ``ttl_s`` after it finished;
- a namespace holds at most ``per_namespace`` futures: a new one beyond that evicts the
  namespace's oldest finished one (retrieved ones first); only when all of them are
  still pending is the call refused (429 naming the cap, which the SDK backs off from).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from loraplex_engine.server.tinker.futures import Future
from loraplex_engine.spec.errors import TooManyRequests
from loraplex_engine.spec.tinker_limits import (
    FUTURE_TTL_S,
    FUTURES_PER_NAMESPACE,
    RETRIEVED_GRACE_S,
)


@dataclass(frozen=True)
class FutureLimits:
    per_namespace: int = FUTURES_PER_NAMESPACE
    ttl_s: float = FUTURE_TTL_S
    grace_s: float = RETRIEVED_GRACE_S


class FutureTable:
    def __init__(self, limits: FutureLimits | None = None) -> None:
        self.limits = limits or FutureLimits()
        self._lock = threading.Lock()
        # namespace -> its futures by request id, in creation order (oldest first)
        self._spaces: dict[str, OrderedDict[str, Future]] = {}

    def new(
        self, namespace: str, kind: str, model_id: str | None = None, request_id: str | None = None
    ) -> Future:
        """``request_id``: a client experiment's ``<model id>#<seq_id>`` (server/tinker/journal.py),
        the same on whichever engine replays it; else a fresh one."""
        with self._lock:
            space = self._spaces.setdefault(namespace, OrderedDict())
            if len(space) >= self.limits.per_namespace and not self._evict_locked(space):
                raise TooManyRequests(
                    f"namespace {namespace!r} has {len(space)} Tinker requests pending, its "
                    f"cap (--tinker-futures-per-namespace {self.limits.per_namespace}); "
                    "retry once some have finished"
                )
            fut = Future(request_id or uuid.uuid4().hex, namespace, kind, model_id=model_id)
            space.pop(fut.request_id, None)
            space[fut.request_id] = fut
            return fut

    def get(self, namespace: str, request_id: str) -> Future | None:
        with self._lock:
            space = self._spaces.get(namespace)
            return None if space is None else space.get(request_id)

    def retrieved(self, fut: Future) -> None:
        """Its client has its final answer: drop it after the grace."""
        if fut.finished is not None and fut.retrieved is None:
            fut.retrieved = time.monotonic()

    def sweep(self) -> None:
        now, lim = time.monotonic(), self.limits
        with self._lock:
            for ns, space in list(self._spaces.items()):
                for rid in [rid for rid, f in space.items() if _expired(f, now, lim)]:
                    del space[rid]
                if not space:
                    del self._spaces[ns]

    def _evict_locked(self, space: OrderedDict[str, Future]) -> bool:
        """Drop the oldest finished future (a retrieved one first); False if all pend."""
        oldest: str | None = None
        for rid, f in space.items():
            if f.finished is None:
                continue
            if f.retrieved is not None:
                oldest = rid
                break
            oldest = oldest or rid
        if oldest is None:
            return False
        del space[oldest]
        return True

    def __len__(self) -> int:
        with self._lock:
            return sum(len(s) for s in self._spaces.values())


def _expired(f: Future, now: float, limits: FutureLimits) -> bool:
    if f.finished is None:
        return False
    if f.retrieved is not None and now - f.retrieved > limits.grace_s:
        return True
    return now - f.finished > limits.ttl_s
