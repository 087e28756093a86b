"""One round's plan for one pool, from one observation (pure, no I/O).

`plan_round` is a pipeline of small steps, each a function of what the one before
produced:

1. **who runs what**: from the live engines' lists, the engines holding each id;
2. **classify** each experiment: adopt what an engine runs (duplicates unloaded),
   unload what must not run (finished, suspended), await a deleted engine's SIGTERM
   checkpoints, recover what a lost engine ran (restarts + 1, resume from
   `status.checkpoint`; every bind names the run, the object's uid, so without a
   checkpoint in the status the engine still resumes the run's newest one), admit or
   reject the rest; engines' ids that no experiment names are orphans, unloaded;
3. **placement inputs**: the engines' slots, ranks and memory, and the pool's limits;
4. **decisions**: `placement.plan` binds, preempts, scales up or says why one waits;
5. **actions**: decisions become engine calls (`Put`, `Unload`) and pod counts, and
   scale-down picks engines idle for `scale_down_delay` above `replicas.min`.

Steps 1 and 2 are classification.py's; the work items they fill and the plan are
round_plan.py's. `reconcile.PoolReconciler` observes and then carries the plan out.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loraplex_operator import placement
from loraplex_operator.api.pool import EnginePoolSpec
from loraplex_operator.api.pool_capacity import Capacity
from loraplex_operator.classification import classify
from loraplex_operator.config import Config
from loraplex_operator.engine_failures import UNSCHEDULABLE, PodFailure
from loraplex_operator.observation import (
    EngineView,
    Snapshot,
    live,
    slot_bytes,
    with_reported_shape,
)
from loraplex_operator.placement import WAIT_STARTING
from loraplex_operator.resources import Experiment
from loraplex_operator.round_plan import PREEMPT, Put, RoundPlan, Unload, Work

log = logging.getLogger("loraplex_operator.planning")


def plan_round(snap: Snapshot, config: Config) -> RoundPlan:
    """Everything one round should do, from one observation (pure)."""
    snap = with_reported_shape(snap)
    engines = live(snap.engines)
    sorted_out = classify(snap, engines, config, slot_bytes(engines))
    inputs, limits = placement_inputs(snap.pool.spec, engines, sorted_out.running_on)
    decisions = placement.plan(sorted_out.pending, inputs, limits)
    acts = act_on(decisions, sorted_out.work, {e.name: e for e in engines})
    unloads = sorted_out.unloads + acts.unloads
    busy = {u.engine for u in unloads} | acts.bound_to | acts.held
    scaling = scale(snap, engines, config, acts.create_pods, busy, acts.waiting)
    create_pods = scaling.create_pods
    if snap.recreate_held is not None and create_pods:
        create_pods = 0  # engine pods keep failing: the next one waits (RecreateBackoff)
        _held_back(decisions, sorted_out.work, snap.recreate_held)
    return RoundPlan(
        work=sorted_out.work,
        unloads=unloads,
        puts=acts.puts,
        create_pods=create_pods,
        delete_pods=[e.name for e in snap.engines if e.dead and not e.terminating]
        + scaling.delete_pods,
        recoveries=sum(w.restarts > w.exp.status.restarts for w in sorted_out.work.values()),
        decisions=decisions,
        idle_since=scaling.idle_since,
    )


def _held_back(
    decisions: Iterable[placement.Decision], work: Mapping[str, Work], held: PodFailure
) -> None:
    """Experiments that wait for an engine not created yet: why it is not created."""
    for d in decisions:
        if isinstance(d, placement.Wait) and d.engine is None and d.reason == WAIT_STARTING:
            work[d.experiment].waiting_reason = held.reason
            work[d.experiment].waiting_message = f"no new engine yet: {held.describe()}"


# --- 3. placement inputs ---------------------------------------------------------------


def placement_inputs(
    pool: EnginePoolSpec,
    engines: Sequence[EngineView],
    running_on: Mapping[str, Sequence[placement.RunningExperiment]],
) -> tuple[list[placement.Engine], placement.PoolLimits]:
    """The live engines as placement sees them, and the pool's limits."""
    capacity = pool.capacity
    inputs = [_placement_engine(e, capacity, running_on.get(e.name, ())) for e in engines]
    limits = placement.PoolLimits(
        max_replicas=pool.replicas.max,
        current_replicas=len(engines),
        slots_per_engine=capacity.max_registered or capacity.max_adapters,
        max_rank=capacity.max_rank,
        memory_budget=capacity.memory_bytes,
        resident_slots=capacity.max_adapters if capacity.max_registered else 0,
    )
    return inputs, limits


def _placement_engine(
    e: EngineView, pool: Capacity, running: Sequence[placement.RunningExperiment]
) -> placement.Engine:
    if not e.usable:  # starting (or unreachable): its room is reserved, never bound to
        return placement.Engine(
            e.name,
            False,
            pool.max_registered or pool.max_adapters,
            0,
            pool.max_rank,
            memory_budget=pool.memory_bytes,
            resident_slots=pool.max_adapters if pool.max_registered else 0,
        )
    said = e.capacity or {}  # what the engine reports wins over the pool's spec
    slots = int(said.get("maxAdapters", pool.max_adapters))
    # A paging engine takes experiments up to the adapters it registers; an engine that
    # does not report `maxRegistered` (before paging) holds what its slots hold.
    registers = e.max_registered
    return placement.Engine(
        name=e.name,
        ready=True,
        slots_total=slots if registers is None else registers,
        slots_used=e.used_slots if registers is None else e.registered,
        max_rank=int(said.get("maxRank", pool.max_rank)),
        memory_budget=pool.memory_bytes,
        memory_used=sum(r.memory_bytes for r in running),
        running=tuple(running),
        resident_slots=slots if registers is not None and registers > slots else 0,
    )


# --- 5. actions ------------------------------------------------------------------------


@dataclass
class Acts:
    """What the placement decisions ask of engines and pods."""

    puts: list[Put] = field(default_factory=list)
    unloads: list[Unload] = field(default_factory=list)  # preemptions
    create_pods: int = 0
    bound_to: set[str] = field(default_factory=set)
    held: set[str] = field(default_factory=set)  # not-ready engines holding someone's room
    waiting: bool = False  # some experiment waits for room that can come


def act_on(
    decisions: Iterable[placement.Decision],
    work: Mapping[str, Work],
    engines: Mapping[str, EngineView],
) -> Acts:
    acts = Acts()
    for d in decisions:
        if isinstance(d, placement.Bind):
            engine, w = engines[d.engine], work[d.experiment]
            acts.puts.append(Put(engine.name, engine.url or "", engine.node, w.key, w.id, _bind(w)))
            acts.bound_to.add(engine.name)
        elif isinstance(d, placement.Preempt):
            engine, victim = engines[d.engine], work[d.victim]
            acts.unloads.append(
                Unload(
                    engine.name, engine.url or "", victim.id, d.victim, PREEMPT, d.for_experiment
                )
            )
        elif isinstance(d, placement.ScaleUp):
            acts.create_pods += d.count
        elif isinstance(d, placement.Wait):
            w = work[d.experiment]
            w.waiting_reason = _waiting_reason(d, engines)
            failing = engines[d.engine].failure if d.engine in engines else None
            if failing is not None:
                w.waiting_message = f"its engine cannot start: {failing.describe()}"
            acts.waiting |= d.reason != placement.WAIT_UNSCHEDULABLE
            if d.engine in engines:
                acts.held.add(d.engine)
    return acts


def _waiting_reason(d: placement.Wait, engines: Mapping[str, EngineView]) -> str:
    """The Wait's reason, or why the engine it waits for cannot serve (its pod's failure:
    CrashLoopBackOff, ImagePullBackOff, ...) or has no node yet (Kueue has not admitted
    it, or no node fits): the user sees what it actually waits for."""
    engine = engines.get(d.engine or "")
    if engine is not None and engine.failure is not None and engine.failure.reason != UNSCHEDULABLE:
        return engine.failure.reason
    return (engine.capacity_pending if engine else None) or d.reason


def _bind(w: Work) -> dict[str, Any]:
    """The engine's PUT body: the spec as written, and where to resume from."""
    return {
        "spec": w.exp.raw_spec,
        "namespace": w.exp.meta.namespace,
        "name": w.exp.meta.name,
        "resumeFrom": w.resume_from,
        "runId": _run_id(w.exp),
    }


def _run_id(exp: Experiment) -> str | None:
    """The run a bind names: the object's uid (one per incarnation, the same through every
    recovery), so the engine writes its checkpoints into a directory of their own and can
    resume the run's newest one without being told where. The API server always sets a
    uid; a hand-made object without one is bound without a run."""
    if exp.meta.uid is None:
        log.warning("%s has no metadata.uid: binding it without a runId", exp.key)
    return exp.meta.uid


@dataclass(frozen=True)
class Scaling:
    create_pods: int
    delete_pods: list[str]
    idle_since: dict[str, float]  # engine -> when it was first seen idle


def scale(
    snap: Snapshot,
    engines: Sequence[EngineView],
    config: Config,
    create_pods: int,
    busy: set[str],
    waiting: bool,
) -> Scaling:
    """Keep at least `replicas.min` engines; remove engines idle for `scale_down_delay`
    above the minimum, newest name first, when nothing waits and nothing is created.
    An engine pod without a node (gated, unschedulable) that holds nobody's room is idle
    too: asked for by a burst that has passed, it would otherwise hold its Kueue quota
    or scheduler slot for ever."""
    lo = snap.pool.spec.replicas.min
    create_pods += max(lo - len(engines) - create_pods, 0)
    idle = [
        e
        for e in engines
        if (e.usable or e.capacity_pending) and not e.experiments and e.name not in busy
    ]
    idle_since = {e.name: snap.idle_since.get(e.name, snap.now) for e in idle}
    delete: list[str] = []
    if not waiting and create_pods == 0:
        removable = len(engines) - lo
        for e in sorted(idle, key=lambda e: e.name, reverse=True):
            if removable <= 0:
                break
            if snap.now - idle_since[e.name] >= config.scale_down_delay:
                delete.append(e.name)
                removable -= 1
    return Scaling(create_pods, delete, idle_since)
