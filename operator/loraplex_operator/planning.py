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

`reconcile.PoolReconciler` observes and then carries the plan out.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loraplex_operator import admission, idle, placement
from loraplex_operator import status as st
from loraplex_operator.api.pool import Capacity, EnginePoolSpec
from loraplex_operator.config import Config
from loraplex_operator.engine_failures import UNSCHEDULABLE, PodFailure
from loraplex_operator.observation import (
    EngineView,
    Snapshot,
    live,
    slot_bytes,
    with_reported_shape,
    wrapped_modules,
)
from loraplex_operator.placement import WAIT_STARTING
from loraplex_operator.resources import Experiment, parse_time
from loraplex_operator.versions import publish_differs

log = logging.getLogger("loraplex_operator.planning")

NORMAL, WARNING = "Normal", "Warning"

# Why an experiment is unloaded from an engine (idle: a client experiment's idle TTL,
# suspended first: idle.py).
FINISHED, SUSPEND, DUPLICATE, ORPHAN, PREEMPT, IDLE = (
    "finished",
    "suspend",
    "duplicate",
    "orphan",
    "preempt",
    "idle",
)


@dataclass
class Work:
    """One experiment through one round: what its status will be derived from."""

    exp: Experiment
    binding: st.Binding | None = None
    engine_status: dict[str, Any] | None = None
    restarts: int = 0
    problems: list[str] = field(default_factory=list)
    waiting_reason: str | None = None
    waiting_message: str | None = None  # what the waiting reason is about, when known
    resume_from: str | None = None
    events: list[tuple[str, str, str]] = field(default_factory=list)  # type, reason, message
    republish: str | None = None  # its engine's URL: spec.publish changed (versions.py)

    @classmethod
    def start(cls, exp: Experiment) -> Work:
        """The experiment's work at the start of a round: its restarts so far."""
        return cls(exp=exp, restarts=exp.status.restarts)

    @property
    def obj(self) -> Mapping[str, Any]:
        return self.exp.raw

    @property
    def key(self) -> str:
        return self.exp.key

    @property
    def id(self) -> str:
        return self.exp.id

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))


@dataclass(frozen=True)
class Unload:
    engine: str
    url: str
    exp_id: str
    key: str | None
    reason: str
    for_key: str | None = None  # preemption: who gets the slot


@dataclass(frozen=True)
class Put:
    engine: str
    url: str
    node: str | None
    key: str
    exp_id: str
    body: dict[str, Any]


@dataclass
class RoundPlan:
    work: dict[str, Work]
    unloads: list[Unload] = field(default_factory=list)
    puts: list[Put] = field(default_factory=list)
    create_pods: int = 0
    delete_pods: list[str] = field(default_factory=list)
    recoveries: int = 0
    decisions: list[placement.Decision] = field(default_factory=list)
    idle_since: dict[str, float] = field(default_factory=dict)


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


# --- 1. who runs what ------------------------------------------------------------------


def holders(engines: Iterable[EngineView]) -> dict[str, list[EngineView]]:
    """Experiment id -> the reachable engines that run it."""
    out: dict[str, list[EngineView]] = {}
    for engine in engines:
        if engine.reachable:
            for exp_id in engine.experiments:
                out.setdefault(exp_id, []).append(engine)
    return out


# --- 2. classify -----------------------------------------------------------------------


@dataclass
class Classified:
    """Each experiment's work, and what classifying them alone decides."""

    work: dict[str, Work] = field(default_factory=dict)
    unloads: list[Unload] = field(default_factory=list)
    pending: list[placement.PendingExperiment] = field(default_factory=list)
    running_on: dict[str, list[placement.RunningExperiment]] = field(default_factory=dict)


def classify(
    snap: Snapshot,
    engines: Sequence[EngineView],
    config: Config,
    slot_bytes: int | None = None,
) -> Classified:
    """``slot_bytes``: what each experiment costs an engine (observation.slot_bytes)."""
    held = holders(engines)
    every_engine = {e.name: e for e in snap.engines}
    out = Classified()
    for exp in sorted(snap.experiments, key=lambda x: x.key):
        if exp.meta.deleting:
            continue  # the finalizer handler unloads it
        w = out.work[exp.key] = Work.start(exp)
        recorded = exp.status.engine
        on = sorted(held.get(exp.id, []), key=lambda e: (e.name != recorded, e.name))
        if exp.status.phase in st.TERMINAL:
            out.unloads.extend(_unloads(on, w, FINISHED))
        elif on:
            unloads, running = _adopt(w, on, snap.pool.spec, slot_bytes)
            out.unloads.extend(unloads)
            if running is not None:
                out.running_on.setdefault(on[0].name, []).append(running)
        else:
            recorded_view = every_engine.get(recorded or "")
            pending = _not_running(w, snap, recorded_view, config, slot_bytes)
            if pending is not None:
                out.pending.append(pending)
    known = {x.id for x in snap.experiments}
    out.unloads.extend(orphan_unloads(held, known))
    return out


def _unloads(engines: Iterable[EngineView], w: Work, reason: str) -> list[Unload]:
    return [Unload(e.name, e.url or "", w.id, w.key, reason) for e in engines]


def orphan_unloads(held: Mapping[str, list[EngineView]], known: set[str]) -> list[Unload]:
    """Experiments an engine runs that no LoRAExperiment of this pool names."""
    return [
        Unload(e.name, e.url or "", exp_id, None, ORPHAN)
        for exp_id, engines in sorted(held.items())
        if exp_id not in known
        for e in engines
    ]


def _adopt(
    w: Work, on: Sequence[EngineView], pool: EnginePoolSpec, slot_bytes: int | None
) -> tuple[list[Unload], placement.RunningExperiment | None]:
    """It runs on `on[0]` (the recorded engine first): take that as the truth."""
    primary = on[0]
    unloads = _unloads(on[1:], w, DUPLICATE)
    w.binding = st.Binding(primary.name, primary.node)
    w.engine_status = dict(primary.experiments[w.id])
    if publish_differs(w.exp.raw_spec, w.engine_status):
        w.republish = primary.url or ""
    if w.exp.status.engine != primary.name:
        w.event(NORMAL, "Adopted", f"found running on engine {primary.name}")
    if w.engine_status.get("phase") in st.TERMINAL:
        return unloads, None  # recorded this round; unloaded once status says so (next round)
    if w.exp.spec.suspend:
        return [*unloads, *_unloads([primary], w, SUSPEND)], None
    if idle.due(w.exp.raw_spec, w.engine_status) is not None:
        return [*unloads, *_unloads([primary], w, IDLE)], None
    running = placement.RunningExperiment(
        key=w.key,
        priority=admission.priority_class(w.exp, pool).value,
        rank=w.exp.spec.lora.rank,
        memory_bytes=admission.experiment_memory_bytes(w.exp.spec, pool, slot_bytes),
        started=parse_time(w.engine_status.get("startedAt")) or 0.0,
    )
    return unloads, running


def _not_running(
    w: Work,
    snap: Snapshot,
    recorded: EngineView | None,
    config: Config,
    slot_bytes: int | None,
) -> placement.PendingExperiment | None:
    """Not running anywhere: the experiment to place, or None (why is in `w`)."""
    exp = w.exp
    if exp.spec.suspend:
        return None
    if exp.status.engine:
        if recorded is not None and recorded.draining(snap.now):
            _await_drain(w, recorded)
            return None
        if not _recover(w, recorded, config):
            return None
    namespace_labels = snap.namespace_labels.get(exp.meta.namespace)
    wrapped = wrapped_modules(snap.engines)
    problems = admission.check_experiment(exp, snap.pool, namespace_labels, slot_bytes, wrapped)
    w.problems = [str(p) for p in problems]
    if w.problems:
        return None
    w.resume_from = exp.status.checkpoint.path
    priority = admission.priority_class(exp, snap.pool.spec)  # admitted: the one it names
    return placement.PendingExperiment(
        key=w.key,
        priority=priority.value,
        created=exp.meta.created or 0.0,
        rank=exp.spec.lora.rank,
        memory_bytes=admission.experiment_memory_bytes(exp.spec, snap.pool.spec, slot_bytes),
        preempts_other_namespaces=priority.preempt_other_namespaces,
    )


def _await_drain(w: Work, engine: EngineView) -> None:
    """Keep the experiment bound to its deleted engine until that engine is gone: it
    checkpoints on SIGTERM, and resuming elsewhere first would race that checkpoint (the
    new engine would start from an older one, and both would write the same steps)."""
    w.binding = st.Binding(engine.name, w.exp.status.node)
    w.engine_status = {"phase": st.RUNNING} if w.exp.status.phase == st.RUNNING else None
    log.info("%s: engine pod %s is shutting down; resume waits for it", w.key, engine.name)


def _recover(w: Work, engine: EngineView | None, config: Config) -> bool:
    """Its recorded engine lost it: count a restart; False once the budget is spent."""
    why = engine.why_lost() if engine else f"engine pod {w.exp.status.engine} is gone"
    w.restarts += 1
    if w.restarts > config.max_restarts:
        w.event(
            WARNING,
            "RestartBudgetExhausted",
            f"{why}; restarted {w.restarts} times (budget {config.max_restarts})",
        )
        return False
    step = w.exp.status.checkpoint.step
    where = (
        f"checkpoint at step {step} or a newer one of its run"
        if step is not None
        else "its run's newest checkpoint, if it has one"
    )
    # "an engine": the one that lost it may take it back (its container restarted in place).
    w.event(WARNING, "EngineLost", f"{why}; will resume from {where} on an engine with room")
    return True


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
