"""Placement: pack pending LoRAExperiments onto engines of one pool (pure, no I/O).

`plan()` takes a snapshot (pending experiments, engines, pool limits) and returns a
deterministic list of decisions:

- `Bind(experiment, engine)` — PUT the experiment onto that ready engine now;
- `Preempt(victim, engine, for_experiment)` — checkpoint and unload a strictly
  lower-priority experiment so that `for_experiment` fits there next round: one of its own
  namespace, or of any namespace when its priority class says `preemptOtherNamespaces`;
- `ScaleUp(count)` — create that many engine pods;
- `Wait(experiment, reason)` — nothing to do for it this round (why, for its status).

Order: priority descending, then age (oldest first), then key. Best fit: among engines
that can host an experiment, the one left with the least rank headroom, then the fewest
free slots, then the least free memory, then by name (`order=SLOTS_FIRST` swaps the
first two; in a pool whose engines share one max rank the two orders agree, and with
mixed max ranks rank-first keeps high-rank engines for high-rank experiments: see
bench/placement_bench.py and docs/design/operator-placement.md). Capacity of not-ready engines
and of engines asked for in this round is reserved (so one burst does not scale up
twice) but never bound to. Preemption happens only when an experiment fits nowhere and
the pool cannot grow; engines are never over-committed. Priorities are class values the
pool's admin set; across namespaces they order the queue, but only a class with
`preemptOtherNamespaces` unloads another namespace's experiment.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

# The pool's spec.modelShape (or its engines' report), with the dimensions of each module.
from loraplex_operator.api.pool_capacity import ModelShape

# --- memory estimate -------------------------------------------------------------------

ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, one value per parameter each
FP32_BYTES = 4


def lora_params(rank: int, target_modules: Iterable[str], shape: ModelShape) -> int:
    """Trainable parameters of one adapter: per layer and module, A is r×in and B is out×r."""
    per_layer = sum(rank * sum(shape.module_dims(m)) for m in set(target_modules))
    return shape.num_layers * per_layer


def adapter_memory_bytes(
    rank: int,
    target_modules: Iterable[str],
    shape: ModelShape | None,
    weight_bytes: int = FP32_BYTES,
) -> int:
    """Bytes one adapter pins on an engine: weights + gradients + fp32 Adam moments.

    Returns 0 when the pool declares no model shape (memory then is not enforced).
    """
    if shape is None:
        return 0
    params = lora_params(rank, target_modules, shape)
    return params * (2 * weight_bytes + ADAM_MOMENTS * FP32_BYTES)


# --- inputs ----------------------------------------------------------------------------


def namespace_of(key: str) -> str:
    """The namespace of a `<namespace>/<name>` key."""
    return key.partition("/")[0]


@dataclass(frozen=True)
class PendingExperiment:
    key: str  # "<namespace>/<name>"
    priority: int  # its priority class's value (api/priority.py), never a tenant's number
    created: float  # creation time, seconds since the epoch
    rank: int
    memory_bytes: int = 0
    # Its class may preempt other namespaces' experiments (the admin's call, not the tenant's).
    preempts_other_namespaces: bool = False

    @property
    def namespace(self) -> str:
        return namespace_of(self.key)

    def may_preempt(self, victim: RunningExperiment) -> bool:
        """Strictly lower priority, and of its own namespace unless its class says otherwise."""
        same_tenant = victim.namespace == self.namespace or self.preempts_other_namespaces
        return same_tenant and victim.priority < self.priority


@dataclass(frozen=True)
class RunningExperiment:
    key: str
    priority: int
    rank: int
    memory_bytes: int = 0
    started: float = 0.0  # newer starters are preempted first among equal priorities

    @property
    def namespace(self) -> str:
        return namespace_of(self.key)


@dataclass(frozen=True)
class Engine:
    name: str
    ready: bool
    slots_total: int
    slots_used: int
    max_rank: int
    memory_budget: int = 0  # 0 = not enforced
    memory_used: int = 0
    running: tuple[RunningExperiment, ...] = ()
    # A paging engine's slots (its `slots_total` counts registered adapters): only this
    # many of its experiments take device memory at once. 0: every one it holds does.
    resident_slots: int = 0


@dataclass(frozen=True)
class PoolLimits:
    """The pool's bounds and the shape of a new engine (from the EnginePool spec)."""

    max_replicas: int
    current_replicas: int  # engine pods that exist, ready or not
    slots_per_engine: int  # registered adapters where the pool sets maxRegistered
    max_rank: int
    memory_budget: int = 0
    resident_slots: int = 0  # a new engine's slots, where it pages (Engine.resident_slots)


# --- outputs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Bind:
    experiment: str
    engine: str


@dataclass(frozen=True)
class Preempt:
    victim: str
    engine: str
    for_experiment: str


@dataclass(frozen=True)
class ScaleUp:
    count: int


@dataclass(frozen=True)
class Wait:
    experiment: str
    reason: str
    engine: str | None = None  # the not-ready engine whose room it holds (WAIT_STARTING)


Decision = Bind | Preempt | ScaleUp | Wait

RANK_FIRST = "rank-first"
SLOTS_FIRST = "slots-first"
FitOrder = Literal["rank-first", "slots-first"]

WAIT_STARTING = "WaitingForEngine"  # reserved on an engine that is starting
WAIT_PREEMPTING = "WaitingForPreemption"  # victims are being checkpointed
WAIT_NO_CAPACITY = "NoCapacity"  # no room, cannot scale, nothing to preempt
WAIT_UNSCHEDULABLE = "Unschedulable"  # no engine of this pool could ever host it


# --- working state ---------------------------------------------------------------------


@dataclass
class _Slotting:
    """Mutable free capacity of one engine (real or planned) during a round."""

    name: str
    free_slots: int
    max_rank: int
    memory_budget: int
    memory_used: int
    running: list[RunningExperiment] = field(default_factory=list)
    slots_total: int = 0
    resident_slots: int = 0

    def fits(self, exp: PendingExperiment) -> bool:
        if self.free_slots < 1 or exp.rank > self.max_rank:
            return False
        return self.memory_fits(exp, self.free_slots, self.memory_used)

    def memory_fits(self, exp: PendingExperiment, free: int, used: int) -> bool:
        """Room for exp's memory with `free` places left and `used` bytes held. On a
        paging engine whose slots are all taken, one more is paged, not resident: the
        device holds no more than its slots (every slot costs the same)."""
        if self.memory_budget <= 0:
            return True
        if self.resident_slots and self.slots_total - free >= self.resident_slots:
            return True
        return used + exp.memory_bytes <= self.memory_budget

    def take(self, exp: PendingExperiment) -> None:
        self.free_slots -= 1
        self.memory_used += exp.memory_bytes

    def release(self, victim: RunningExperiment) -> None:
        self.running.remove(victim)
        self.free_slots += 1
        self.memory_used -= victim.memory_bytes

    def fit_key(self, exp: PendingExperiment, order: FitOrder) -> tuple[int, int, int, str]:
        slots_left = self.free_slots - 1
        rank_left = self.max_rank - exp.rank
        mem_left = max(self.memory_budget - self.memory_used - exp.memory_bytes, 0)
        if order == RANK_FIRST:
            return (rank_left, slots_left, mem_left, self.name)
        return (slots_left, rank_left, mem_left, self.name)


def _slotting(engine: Engine) -> _Slotting:
    return _Slotting(
        name=engine.name,
        free_slots=max(engine.slots_total - engine.slots_used, 0),
        max_rank=engine.max_rank,
        memory_budget=engine.memory_budget,
        memory_used=engine.memory_used,
        running=sorted(engine.running, key=_victim_order),
        slots_total=engine.slots_total,
        resident_slots=engine.resident_slots,
    )


def _new_engine(limits: PoolLimits, index: int) -> _Slotting:
    return _Slotting(
        name=f"<new-{index}>",
        free_slots=limits.slots_per_engine,
        max_rank=limits.max_rank,
        memory_budget=limits.memory_budget,
        memory_used=0,
        slots_total=limits.slots_per_engine,
        resident_slots=limits.resident_slots,
    )


def _victim_order(r: RunningExperiment) -> tuple[int, float, str]:
    """Lowest priority first; among equals the most recently started (least work lost)."""
    return (r.priority, -r.started, r.key)


def _queue_order(p: PendingExperiment) -> tuple[int, float, str]:
    return (-p.priority, p.created, p.key)


def _best_fit(
    candidates: Sequence[_Slotting], exp: PendingExperiment, order: FitOrder
) -> _Slotting | None:
    fitting = [c for c in candidates if c.fits(exp)]
    return min(fitting, key=lambda c: c.fit_key(exp, order)) if fitting else None


# --- preemption ------------------------------------------------------------------------


def _victims_on(engine: _Slotting, exp: PendingExperiment) -> list[RunningExperiment] | None:
    """Fewest victims `exp` may preempt (cheapest first) that make it fit, or None."""
    if exp.rank > engine.max_rank:
        return None
    free, mem = engine.free_slots, engine.memory_used
    chosen: list[RunningExperiment] = []
    # In victim order; another namespace's experiment is skipped, not a stop: a lower one
    # of exp's own namespace may still come after it.
    for victim in (v for v in engine.running if exp.may_preempt(v)):
        if free >= 1 and engine.memory_fits(exp, free, mem):
            break
        chosen.append(victim)
        free += 1
        mem -= victim.memory_bytes
    return chosen if free >= 1 and engine.memory_fits(exp, free, mem) else None


def _preemption(
    engines: Sequence[_Slotting], exp: PendingExperiment
) -> tuple[_Slotting, list[RunningExperiment]] | None:
    options = []
    for engine in engines:
        victims = _victims_on(engine, exp)
        if victims:
            cost = (max(v.priority for v in victims), len(victims), engine.name)
            options.append((cost, engine, victims))
    if not options:
        return None
    _, engine, victims = min(options, key=lambda o: o[0])
    return engine, victims


# --- the round -------------------------------------------------------------------------


def plan(
    pending: Iterable[PendingExperiment],
    engines: Iterable[Engine],
    limits: PoolLimits,
    order: FitOrder = RANK_FIRST,
) -> list[Decision]:
    """One placement round for one pool. Deterministic for the same inputs.

    `order` picks the best-fit key: RANK_FIRST (least rank headroom, then fewest free
    slots, then least free memory) or SLOTS_FIRST (slots, then rank, then memory).
    """
    ordered_engines = sorted(engines, key=lambda e: e.name)
    ready = [_slotting(e) for e in ordered_engines if e.ready]
    starting = [_slotting(e) for e in ordered_engines if not e.ready]
    planned: list[_Slotting] = []
    room_to_grow = max(limits.max_replicas - limits.current_replicas, 0)
    decisions: list[Decision] = []

    for exp in sorted(pending, key=_queue_order):
        target = _best_fit(ready, exp, order)
        if target is not None:
            target.take(exp)
            decisions.append(Bind(exp.key, target.name))
            continue
        future = _best_fit(starting + planned, exp, order)
        if future is not None:
            future.take(exp)
            held = future.name if any(future is s for s in starting) else None
            decisions.append(Wait(exp.key, WAIT_STARTING, held))
            continue
        fresh = _new_engine(limits, len(planned))
        if len(planned) < room_to_grow and fresh.fits(exp):
            fresh.take(exp)
            planned.append(fresh)
            decisions.append(Wait(exp.key, WAIT_STARTING))
            continue
        decisions.extend(_preempt_or_wait(ready, exp, could_ever_fit=_could_fit(exp, limits)))

    if planned:
        decisions.insert(0, ScaleUp(len(planned)))
    return decisions


def _could_fit(exp: PendingExperiment, limits: PoolLimits) -> bool:
    return _new_engine(limits, 0).fits(exp)


def _preempt_or_wait(
    ready: Sequence[_Slotting], exp: PendingExperiment, could_ever_fit: bool
) -> list[Decision]:
    found = _preemption(ready, exp)
    if found is None:
        reason = WAIT_NO_CAPACITY if could_ever_fit else WAIT_UNSCHEDULABLE
        return [Wait(exp.key, reason)]
    engine, victims = found
    for victim in victims:
        engine.release(victim)
    engine.take(exp)  # reserved for exp: later, lower-priority experiments cannot take it
    preempts: list[Decision] = [Preempt(v.key, engine.name, exp.key) for v in victims]
    return [*preempts, Wait(exp.key, WAIT_PREEMPTING)]
