"""Client work inside fair share: how much of the client models' queued calls a training
tick takes, per namespace (docs/design/tenancy.md, *Client work*).

A tick used to take every queued ``forward``/``forward_backward`` and every queued sample:
each within ``--max-step-tokens``, but together unbounded (4 models x 6 maximal calls made
a 27 s tick; a co-tenant kept 0.00 of its pace). Now a namespace's queued work is a list
of *lanes* (one per model, one for its samples) of :class:`Work` items, each costing the
tokens of its rows (a training call's data; a sample's ``n x (prompt + max_tokens)``),
and the tick takes it by the experiments' rule (tick/fair_share.py):

- the cheapest tenant sets the pace: the least of the running experiments' step costs
  (``reference``), every namespace's queued demand, and the demand of every namespace
  served within ``RECENT_S`` (its client is sending its next call: it is still a tenant);
- a namespace whose demand is under ``LOCKSTEP`` x the cheapest is *cheap*: all its work
  runs this tick (neighbours of one size stay in lockstep);
- the others are *dear* and share one budget, ``cheapest / EXPENSIVE_YIELD`` tokens a tick
  in which a co-tenant ran, taken in turn (round-robin over namespaces, then over their
  lanes, resuming where the last tick stopped) until the next item would pass it. The
  first item of a turn is taken whatever its cost, so a call larger than the budget runs
  alone and nothing starves; what it took past the budget is a debt the next ticks pay
  before the pool takes anything again. So beside a small tenant the dear ones hold
  about a quarter of a tick's tokens, whatever their number, sizes or names of models;
- a tick takes at most ``ceiling`` (``--max-step-tokens``) tokens in all, at least one
  item: no tick holds the engine longer than a maximal step's rows.

A lane's items are taken as a prefix (the walk stops at the first item that does not
fit), so a model's calls keep their order; a model's ``optim_step`` is one item with the
training call before it, so it runs in the tick that runs the last of its calls.

Pure: no lock, the caller passes the clock's time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from loraplex_engine.tenancy.work_limits import EXPENSIVE_YIELD

T = TypeVar("T")

LOCKSTEP = 1.5  # as fair_share.rollout_interval: under 1.5x the cheapest runs every tick
RECENT_S = 1.0  # a namespace served this recently is a co-tenant while its call is on its way
SETTLED_S = 0.001  # settles_at() answers this long after a window ends: past its last instant


@dataclass(frozen=True)
class Work(Generic[T]):
    """One item of a namespace's client work: a training call (with the ``optim_step``
    after it when that is the segment's last), a sample call, or another call.

    ``cost``: its tokens, what the tick's budgets spend. ``pace``: what it says of its
    namespace's size, the demand the cheapest tenant and the lockstep are judged by (None:
    its cost). An ``optim_step``'s is 0: it ends a step its training call priced, and
    comes with it or a moment after it (taking.late_steps), so two clients of one size
    look alike whichever way it came."""

    namespace: str
    cost: int
    item: T
    pace: int | None = None

    @property
    def size(self) -> int:
        return self.cost if self.pace is None else self.pace


Lanes = dict[str, list[list[Work[T]]]]  # namespace -> its lanes, each in call order


@dataclass
class Plan(Generic[T]):
    taken: list[Work[T]]
    credit: int  # the dear pool's after this tick (<= 0: a debt)
    cursor: str | None
    dear: bool  # some namespace was dear


@dataclass
class ClientShare:
    ceiling: int  # tokens a tick takes at most (at least one item)
    credit: int = 0  # the dear pool's: <= 0, a debt from a call larger than its budget
    cursor: str | None = None  # the dear namespace that goes first next tick
    seen: dict[str, tuple[float, int]] = field(default_factory=dict)  # ns -> (when, demand)

    def plan(self, lanes: Lanes[T], reference: int | None, now: float) -> Plan[T]:
        """What a tick starting ``now`` would take; changes nothing."""
        demand = {ns: d for ns, d in _demand(lanes).items() if any(lanes[ns])}
        # A namespace served lately with nothing priced queued now counts at its demand
        # then: its next call is on its way, or what it has queued is the pace-free rest
        # of a step (its optim_step).
        recent = {ns: d for ns, (t, d) in self.seen.items() if now - t <= RECENT_S}
        pace = {**recent, **{ns: d for ns, d in demand.items() if d > 0}}
        costs = [c for c in (reference or 0, *pace.values()) if c > 0]
        cheapest = min(costs, default=0)
        cheap = [ns for ns, d in demand.items() if d < LOCKSTEP * cheapest or cheapest == 0]
        dear = sorted(ns for ns in demand if ns not in cheap)
        taken, spent, _ = _walk(_in_turn(lanes, sorted(cheap)), self.ceiling)
        if not dear:
            return Plan(taken, 0, self.cursor, False)
        others_ran = reference is not None or spent > 0
        allowance = self.credit + (max(1, cheapest // EXPENSIVE_YIELD) if others_ran else 0)
        if allowance <= 0:
            return Plan(taken, allowance, self.cursor, True)
        order = _rotate(dear, self.cursor)
        budget = min(allowance, self.ceiling - spent)
        mine, used, stopped = _walk(_in_turn(lanes, order), budget)
        cursor = stopped.namespace if stopped is not None else _after(order, mine)
        return Plan(taken + mine, min(0, allowance - used), cursor, True)

    def take(self, lanes: Lanes[T], reference: int | None, now: float) -> list[Work[T]]:
        """What a tick starting ``now`` takes; the share's state moves on."""
        plan = self.plan(lanes, reference, now)
        self.credit = plan.credit if plan.dear else 0  # no dear work: nothing to pay back
        self.cursor = plan.cursor
        for ns, d in _demand(lanes).items():
            if d > 0 and any(w.namespace == ns for w in plan.taken):
                self.seen[ns] = (now, d)
        self.seen = {ns: s for ns, s in self.seen.items() if now - s[0] <= RECENT_S}
        return plan.taken

    def settles_at(self, now: float) -> float | None:
        """When the oldest namespace served within ``RECENT_S`` of ``now`` stops counting
        as a co-tenant: what a held-back namespace may take can change then with no new
        call, so an idle engine looks again at that moment, not a poll later. Just past
        the window's end (plan() counts its last instant as recent); None: none is recent."""
        ends = [t + RECENT_S for t, _ in self.seen.values() if now - t <= RECENT_S]
        return min(ends) + SETTLED_S if ends else None


def _demand(lanes: Lanes[T]) -> dict[str, int]:
    """Each namespace's queued demand, by its items' pace (``Work.size``)."""
    return {ns: sum(w.size for lane in ls for w in lane) for ns, ls in lanes.items()}


def _in_turn(lanes: Lanes[T], order: Sequence[str]) -> Iterator[Work[T]]:
    """Round-robin over ``order``'s namespaces, each giving its lanes' items round-robin."""
    streams = [_lanes_in_turn(lanes[ns]) for ns in order]
    while streams:
        alive = []
        for stream in streams:
            item = next(stream, None)
            if item is not None:
                yield item
                alive.append(stream)
        streams = alive


def _lanes_in_turn(lanes: list[list[Work[T]]]) -> Iterator[Work[T]]:
    depth = 0
    while any(depth < len(lane) for lane in lanes):
        yield from (lane[depth] for lane in lanes if depth < len(lane))
        depth += 1


def _walk(items: Iterator[Work[T]], budget: int) -> tuple[list[Work[T]], int, Work[T] | None]:
    """Items in order until the next would pass ``budget`` (the first is taken whatever
    its cost), their tokens, and the item it stopped at (None: all taken). Stopping at the
    first that does not fit keeps every lane's share a prefix."""
    taken: list[Work[T]] = []
    spent = 0
    for w in items:
        if taken and spent + w.cost > budget:
            return taken, spent, w
        taken.append(w)
        spent += w.cost
    return taken, spent, None


def _rotate(order: list[str], cursor: str | None) -> list[str]:
    if cursor is None:
        return order
    at = next((i for i, ns in enumerate(order) if ns >= cursor), 0)
    return order[at:] + order[:at]


def _after(order: list[str], taken: list[Work[T]]) -> str | None:
    """The namespace after the last one served (all of the pool's work fitted)."""
    if not taken:
        return order[0]
    at = order.index(taken[-1].namespace) + 1
    return order[at % len(order)]
