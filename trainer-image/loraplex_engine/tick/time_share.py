"""Serving inside fair share: the engine's time between training ticks and serving ticks.

A completion request used to ride the next tick's rollout batch, outside every bound the
training tenants have: eight long requests (n=16, 480 tokens) held a co-tenant at 0.05
of its steps/s for 80 s (issue 26). Now the loop runs two kinds of tick, and stride
scheduling over their measured seconds decides which runs next:

- each kind has a share (``--serving-share``, default 0.25; training the rest); a tick's
  seconds advance its kind's virtual time by ``seconds / share``, and of the kinds that
  have work the one with the lower virtual time goes next (a tie goes to serving: a lone
  request waits for at most the tick in progress);
- so while both have work, serving gets its share of the engine's time and training the
  rest, whatever the other's load, and a kind alone gets all of it;
- time is not banked: a kind that comes back after waiting with nothing to do starts level
  with the other (as CFS's ``min_vruntime``), so an hour of idle serving does not buy an
  hour of serving ticks.

A serving tick takes queued requests in turn across models (one model's flood does not
delay another's request by more than a tick) up to ``max_step_tokens`` of rows x (prompt
+ max_tokens), at least one request: the same bound as a training step, so neither kind's
tick holds the other longer than a maximal step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, TypeVar

from loraplex_engine.spec.api_types import DEFAULT_SERVING_SHARE

TickKind = Literal["train", "serve"]
KINDS: tuple[TickKind, ...] = ("serve", "train")  # the tie-break order

_J = TypeVar("_J")


class TimeShare:
    """Which kind of tick runs next; pure (the caller measures and charges seconds)."""

    def __init__(self, serving_share: float = DEFAULT_SERVING_SHARE) -> None:
        if not 0.0 < serving_share < 1.0:
            raise ValueError(f"serving_share must be between 0 and 1, got {serving_share}")
        self.shares: dict[TickKind, float] = {"serve": serving_share, "train": 1 - serving_share}
        self.virtual: dict[TickKind, float] = dict.fromkeys(KINDS, 0.0)
        self._waiting: set[TickKind] = set()  # kinds that had work at the last pick
        # The least virtual time of the kinds with work, never decreasing (CFS's
        # min_vruntime): a kind that comes back from having no work starts no lower.
        self._floor = 0.0

    def pick(self, *, train: bool, serve: bool) -> TickKind | None:
        """The kind of the next tick among those with work; None: no work."""
        wanting = [k for k, has in (("serve", serve), ("train", train)) if has]
        for kind in wanting:
            if kind not in self._waiting:
                self.virtual[kind] = max(self.virtual[kind], self._floor)
        self._waiting = set(wanting)
        if not wanting:
            return None
        return min(wanting, key=lambda k: (self.virtual[k], KINDS.index(k)))

    def charge(self, kind: TickKind, seconds: float) -> None:
        self.virtual[kind] += max(seconds, 0.0) / self.shares[kind]
        waiting = [self.virtual[k] for k in self._waiting] or [self.virtual[kind]]
        self._floor = max(self._floor, min(waiting))


def take_in_turn(
    queue: Sequence[_J], model_of: Callable[[_J], str], cost_of: Callable[[_J], int], budget: int
) -> tuple[list[_J], list[_J]]:
    """(taken, left) of ``queue``: round-robin over models in arrival order, until the next
    one would pass ``budget`` tokens (the first is taken whatever its cost). ``left`` keeps
    arrival order."""
    lanes: dict[str, list[int]] = {}
    for index, job in enumerate(queue):
        lanes.setdefault(model_of(job), []).append(index)
    order = []
    depth = 0
    while len(order) < len(queue):
        order += [lane[depth] for lane in lanes.values() if depth < len(lane)]
        depth += 1
    taken: set[int] = set()
    spent = 0
    for index in order:
        cost = cost_of(queue[index])
        if taken and spent + cost > budget:
            break
        taken.add(index)
        spent += cost
    picked = [queue[i] for i in order if i in taken]
    return picked, [job for i, job in enumerate(queue) if i not in taken]
