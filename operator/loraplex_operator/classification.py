"""Steps 1 and 2 of a round's plan (planning.py; pure): who runs what, from the live
engines' lists, then each experiment sorted by what becomes of it: adopt what an engine
runs (duplicates unloaded), unload what must not run (finished, suspended, idle), await a
deleted engine's SIGTERM checkpoints, recover what a lost engine ran (restarts + 1,
resume from `status.checkpoint`), admit or reject the rest; engines' ids that no
experiment names are orphans, unloaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from loraplex_operator import admission, idle, placement
from loraplex_operator import status as st
from loraplex_operator.api.pool import EnginePoolSpec
from loraplex_operator.config import Config
from loraplex_operator.observation import EngineView, Snapshot, wrapped_modules
from loraplex_operator.resources import parse_time
from loraplex_operator.round_plan import (
    DUPLICATE,
    FINISHED,
    IDLE,
    NORMAL,
    ORPHAN,
    SUSPEND,
    WARNING,
    Unload,
    Work,
)
from loraplex_operator.versions import publish_differs

log = logging.getLogger("loraplex_operator.classification")


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
