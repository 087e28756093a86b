"""Fair share between tenants of one tick: who rolls out now, and rewards that wait.

Two rules keep one experiment from holding the others back (docs/design/tenancy.md,
"Tenancy and trust"):

- **Rewards run concurrently, with a deadline.** Every experiment's reward is scored on
  a thread pool; the tick waits at most ``deadline_s`` for them. A reward not back by
  then stays pending: its experiment skips ticks (its rollout waits, its adapter is not
  touched, so the step stays on-policy) and trains in the first tick after the reward
  arrives. The reward's own deadline (tenancy/reward_exchange.py) still fails it in the end.
- **A namespace has at most MAX_REWARD_CALLS_PER_NAMESPACE calls outliving their tick.**
  Its experiments do not roll out while that many are in flight (pending, or left
  running by a removed experiment), so one tenant's hanging service cannot pile up
  threads and sockets. A removed experiment's reward is closed (``forget``), which ends
  its call at once. Under the pipelined schedule an experiment allowing staleness
  (``algorithm.maxStaleness``) may have several rewards pending, returned in the order
  they were started (tick/pipelined.py trains its rollouts in that order).
- **Expensive steps yield.** An experiment whose step costs k >= 1.5 times the cheapest
  running one's (prompt + completion tokens over its rows) rolls out every
  round(EXPENSIVE_YIELD x k)-th tick, so beside it the cheap one keeps about three
  quarters of its pace alone (when a tick's time follows its tokens) and a maximal or
  long-prompt spec cannot hold every tick at its own size. Not token-equal on purpose:
  equal shares would halve a small tenant beside one big one. Costs under 1.5x round to
  1: experiments of one size stay in lockstep.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Generic, TypeVar

from loraplex_engine.experiment import Experiment
from loraplex_engine.tenancy.work_limits import EXPENSIVE_YIELD

_R = TypeVar("_R")

# Calls in flight past their tick, per namespace. Its experiments have one each at most,
# so a tenant with fewer experiments never meets it; a tick adds at most one per running
# experiment on top.
MAX_REWARD_CALLS_PER_NAMESPACE = 8


@dataclass
class _Pending(Generic[_R]):
    exp: Experiment
    future: Future[_R]


class RewardScorer(Generic[_R]):
    """Scores each experiment's reward on a thread of its own (under the sync schedule an
    experiment has at most one reward in flight, under the pipelined one 1 + maxStaleness;
    a namespace's are bounded by ``max_per_namespace``). Daemon threads,
    not a ThreadPoolExecutor: the interpreter joins a pool's threads at exit, so a reward
    service that hangs would hold SIGTERM past the pod's grace period. ``notify`` is
    called when a pending reward arrives, so the engine loop wakes up for it."""

    def __init__(
        self,
        deadline_s: float,
        notify: Callable[[], None],
        max_per_namespace: int = MAX_REWARD_CALLS_PER_NAMESPACE,
    ) -> None:
        self.deadline_s = deadline_s
        self.max_per_namespace = max_per_namespace
        self._notify = notify
        self._pending: list[_Pending[_R]] = []  # in the order they were started
        self._in_flight: Counter[str] = Counter()  # namespace -> calls still running
        self._lock = threading.Lock()

    def is_pending(self, exp: Experiment) -> bool:
        return self.pending(exp) > 0

    def pending(self, exp: Experiment) -> int:
        """How many of ``exp``'s rewards are pending."""
        with self._lock:
            return sum(p.exp.id == exp.id for p in self._pending)

    def waits(self, exp: Experiment) -> bool:
        """``exp`` may not roll out now: its reward is pending, or its namespace has
        ``max_per_namespace`` calls in flight."""
        return self.is_pending(exp) or self.namespace_full(exp)

    def namespace_full(self, exp: Experiment) -> bool:
        """``exp``'s namespace has ``max_per_namespace`` calls in flight."""
        with self._lock:
            return self._in_flight[exp.namespace] >= self.max_per_namespace

    def in_flight(self, namespace: str) -> int:
        with self._lock:
            return self._in_flight[namespace]

    def has_arrived(self) -> bool:
        """A pending reward is back (the next tick has work)."""
        with self._lock:
            return any(p.future.done() for p in self._pending)

    def forget(self, exp: Experiment) -> None:
        """Drop the pending rewards of an experiment that was removed, and close its
        reward: a call blocked on the service returns now, its thread and socket end."""
        with self._lock:
            self._pending = [p for p in self._pending if p.exp.id != exp.id]
        exp.task.close()

    def arrived(self, running: Sequence[Experiment]) -> list[_R]:
        """Results of pending rewards that are back, for experiments still running, in
        the order they were started."""
        out: list[_R] = []
        with self._lock:
            done = [p.future.done() for p in self._pending]  # once: a call may end now
            back = [p for p, d in zip(self._pending, done, strict=True) if d]
            self._pending = [p for p, d in zip(self._pending, done, strict=True) if not d]
        for p in back:
            if any(e is p.exp for e in running):
                out.append(p.future.result())
        return out

    def score(self, jobs: Sequence[tuple[Experiment, Callable[[], _R]]]) -> list[_R]:
        """Run every job on the pool; return the results back within the deadline. The
        others stay pending (collected by :meth:`arrived` in a later tick)."""
        submitted = [(exp, self._start(exp.namespace, fn)) for exp, fn in jobs]
        if submitted:
            wait_futures([f for _, f in submitted], timeout=self.deadline_s)
        done: list[_R] = []
        for exp, future in submitted:
            if future.done():
                done.append(future.result())
                continue
            with self._lock:
                self._pending.append(_Pending(exp, future))
            future.add_done_callback(lambda _f: self._notify())
        return done

    def close(self) -> None:
        """Drop every pending reward and close it (its thread ends with its call)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for p in pending:
            p.exp.task.close()

    def _start(self, namespace: str, fn: Callable[[], _R]) -> Future[_R]:
        future: Future[_R] = Future()

        def run() -> None:
            try:
                result: _R = fn()
            except BaseException as e:  # handed to whoever reads the future
                self._ended(namespace)
                future.set_exception(e)
            else:
                self._ended(namespace)  # before the future wakes the loop: room is back
                future.set_result(result)

        with self._lock:
            self._in_flight[namespace] += 1
        threading.Thread(target=run, name="reward", daemon=True).start()
        return future

    def _ended(self, namespace: str) -> None:
        with self._lock:
            self._in_flight[namespace] -= 1
            if self._in_flight[namespace] <= 0:
                del self._in_flight[namespace]


def due_to_roll_out(eligible: Sequence[Experiment], tick_no: int) -> list[Experiment]:
    """The experiments that roll out in tick ``tick_no``: each one ``every`` ticks after
    its last rollout (:func:`rollout_interval`). When none is due, those nearest to due
    (no tick is left empty while work is waiting)."""
    if not eligible:
        return []
    cheapest = min((e.step_cost for e in eligible if e.step_cost > 0), default=0)

    def ticks_left(e: Experiment) -> int:
        return rollout_interval(e.step_cost, cheapest) - (tick_no - e.rolled_out_at)

    left = {e.id: ticks_left(e) for e in eligible}
    due = [e for e in eligible if left[e.id] <= 0]
    if due:
        return due
    soonest = min(left.values())
    return [e for e in eligible if left[e.id] == soonest]


def rollout_interval(cost: int, cheapest: int) -> int:
    """Every how many ticks a step of ``cost`` tokens rolls out beside the ``cheapest``
    running step: 1 under 1.5x the cheapest (0: not known yet), else EXPENSIVE_YIELD x
    the ratio, rounded."""
    if cost <= 0 or cheapest <= 0 or cost < 1.5 * cheapest:
        return 1
    return round(EXPENSIVE_YIELD * cost / cheapest)
