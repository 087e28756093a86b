"""A training tick's working set when adapters are paged (memory/paging.py): which
experiments and how many client models this tick takes, chosen before any of them runs,
so that one tick pages each member in at most once and never evicts another member.

The slots are shared out as: experiments with work in flight (a reward or a multi-turn
step pending: their rolled-out rows train against their slot) keep theirs; one slot stays
free for a sample call's spare adapter when samples wait; the rest go to the experiments
that would roll out and the client models with calls queued, half each when both want
more than half, the least recently served experiments first (so every registered one
progresses in turn, however many there are).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex_engine.experiment import Experiment
from loraplex_engine.memory.paging import AdapterPager


@dataclass(frozen=True)
class WorkingSet:
    experiments: list[Experiment]  # the running experiments this tick takes
    client_room: int | None  # client models it may take (None: paging is off)
    pinned: frozenset[str]  # adapters with work in flight


@dataclass
class WorkingSets:
    pager: AdapterPager
    _served: dict[str, int] = field(default_factory=dict)  # experiment id -> tick served
    _count: int = 0

    def choose(
        self,
        running: list[Experiment],
        waits: Callable[[Experiment], bool],
        client_demand: int,
        samples: bool,
    ) -> WorkingSet:
        if not self.pager.enabled or not self.pager.pages:  # every one in its slot
            return WorkingSet(running, None, frozenset())
        self._count += 1
        pinned = [e for e in running if waits(e)]
        ready = [e for e in running if not waits(e)]
        ready.sort(key=lambda e: self._served.get(e.id, 0))  # least recently served first
        budget = max(1, self.pager.model.max_adapters - len(pinned) - int(samples))
        half = budget // 2 if ready and client_demand else budget
        client_room = min(client_demand, max(half, budget - len(ready)))
        chosen = ready[: budget - client_room]
        for e in chosen:
            self._served[e.id] = self._count
        return WorkingSet(pinned + chosen, client_room, frozenset(e.id for e in pinned))

    def forget(self, exp_id: str) -> None:
        self._served.pop(exp_id, None)
