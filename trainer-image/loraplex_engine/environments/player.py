"""Every experiment's multi-turn episodes, each at its own environment's pace.

An environment's calls (start the step's episodes, answer a turn) are round trips to
its experiment's plug-in worker, each bounded by ``--plugin-timeout``. None of them is
made on the tick's thread: each is sent on a thread of its own and the tick goes on.
Within a tick the player plays turns in rounds: every experiment whose environment has
answered gets its next turn in one generate call (the fused design, turn by turn), then
its environment is sent those turns. The tick waits for the calls it sent at most
``deadline_s`` (the engine's ``--reward-deadline``, as for rewards): a fast environment
plays a whole step in one tick, a slow one's experiment simply has no turn until its
answer is back (its episodes wait, its step completes in a later tick) while the
others' rollouts and updates go on. Its adapter is not updated meanwhile (the experiment
is not planned again until its step is done), so the step stays on-policy.

A call past its bound kills the worker and fails that experiment alone (host.py). An
experiment removed while its call is in flight has its session closed (which ends the
call): its episodes are dropped, never reported.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from loraplex_engine.environments.episodes import EpisodeGroup
from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.spec.errors import LoraplexError

_T = TypeVar("_T")
Generate = Callable[[list[RolloutRequest]], list[Completion]]


@dataclass(eq=False)
class _Playing(Generic[_T]):
    owner: _T  # the caller's (the tick's Rollout)
    group: EpisodeGroup
    call: Future[Any] | None = None  # the environment's call in flight: start, or a turn


class EpisodePlayer(Generic[_T]):
    """The groups in play, across ticks; used from the tick's thread only."""

    def __init__(self, deadline_s: float | None, notify: Callable[[], None] = lambda: None) -> None:
        self.deadline_s = deadline_s  # None: wait for every call (tests, one-shot play)
        self._notify = notify  # an answer outlived its tick: the engine loop has work
        self._playing: dict[int, _Playing[_T]] = {}  # by id(group.session)

    def waits(self, session: object) -> bool:
        """The experiment of ``session`` has a step in play (it is not planned again)."""
        return id(session) in self._playing

    def has_arrived(self) -> bool:
        """An environment answered a call left from an earlier tick."""
        return any(p.call is not None and p.call.done() for p in self._playing.values())

    def play(
        self,
        started: Sequence[tuple[_T, EpisodeGroup]],
        generate: Generate,
        decode: Callable[[list[int]], str],
    ) -> list[tuple[_T, EpisodeGroup]]:
        """Start ``started``'s groups, then play turns while environments answer within
        the deadline; returns the groups that ended now (episodes all done, or ``error``
        set: that experiment fails)."""
        deadline = None if self.deadline_s is None else time.monotonic() + self.deadline_s
        sent: list[Future[Any]] = []  # this tick's calls: waited for up to the deadline
        for owner, g in started:
            p = _Playing(owner, g)
            self._playing[id(g.session)] = p
            if not g.opened:  # (a caller may have started it: tests)
                sent.append(self._send(p, lambda g=g: g.session.open(g.prompts)))
        ended: list[tuple[_T, EpisodeGroup]] = []
        while True:
            _wait([f for f in sent if not f.done()], deadline)
            ready = self._collect(ended)
            going = [(p, e) for p in ready for e in p.group.live()]
            if not going:
                break
            outs = generate([e.next_request() for _, e in going])
            for (p, e), c in zip(going, outs, strict=True):
                p.group.take(e, c)
            for p in {id(p): p for p, _ in going}.values():
                if p.group.live():
                    sent.append(self._step(p, decode))
        for p in self._playing.values():  # answers that outlive this tick wake the loop
            if p.call is not None:
                p.call.add_done_callback(lambda _f: self._notify())
        return ended

    def _collect(self, ended: list[tuple[_T, EpisodeGroup]]) -> list[_Playing[_T]]:
        """Apply the answers that are back; the groups ready for a turn (those that
        ended go to ``ended``, those of a closed session are dropped)."""
        ready = []
        for key, p in list(self._playing.items()):
            g = p.group
            if g.session.closed:  # its experiment was removed
                del self._playing[key]
                continue
            if p.call is not None:
                if not p.call.done():
                    continue
                _apply(g, p.call)
                p.call = None
            if g.error or (g.opened and not g.live()):
                del self._playing[key]
                g.session.close_episodes([e.id for e in g.episodes])
                ended.append((p.owner, g))
            else:
                ready.append(p)
        return ready

    def _step(self, p: _Playing[_T], decode: Callable[[list[int]], str]) -> Future[Any]:
        actions = [(e.id, decode(e.last_turn())) for e in p.group.live()]
        return self._send(p, lambda: p.group.session.step(actions))

    @staticmethod
    def _send(p: _Playing[_T], call: Callable[[], Any]) -> Future[Any]:
        """``call`` on a daemon thread (a pool's threads are joined at exit: a call in
        flight would hold the engine's shutdown)."""
        future: Future[Any] = Future()

        def run() -> None:
            try:
                result = call()
            except BaseException as e:  # handed to the tick, which fails the experiment
                future.set_exception(e)
            else:
                future.set_result(result)

        p.call = future
        threading.Thread(target=run, name="environment", daemon=True).start()
        return future


def _wait(futures: list[Future[Any]], deadline: float | None) -> None:
    if not futures:
        return
    left = None if deadline is None else deadline - time.monotonic()
    if left is None or left > 0:
        wait(futures, timeout=left)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:500]


def _apply(g: EpisodeGroup, call: Future[Any]) -> None:
    """The environment's answer: the episodes' first texts, or a turn's steps."""
    try:
        result = call.result()
    except Exception as e:  # the environment's failure is its experiment's
        g.fail(f"environment failed: {_one_line(e)}", "reward_error")
        return
    try:
        if g.opened:
            g.answer(result)
        else:
            g.start(*result)
    except LoraplexError as e:  # a first text over the prompt limit: the task's
        g.fail(f"task failed: {_one_line(e)}", "task_error")
    except Exception as e:  # an observation the chat template refused (a role it rejects)
        g.fail(f"environment failed: {type(e).__name__}: {_one_line(e)}", "reward_error")


def play(
    groups: Sequence[EpisodeGroup], generate: Generate, decode: Callable[[list[int]], str]
) -> None:
    """Play ``groups`` to their ends at once (no deadline): the driver without ticks."""
    EpisodePlayer[None](None).play([(None, g) for g in groups], generate, decode)
