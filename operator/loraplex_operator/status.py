"""Status derivation for LoRAExperiment (pure, no I/O).

`derive_status()` turns what the operator observed — the object, its binding, the
engine's experiment status (docs/engine-api.md), admission problems, restarts — into
the `status` to patch, a typed `api.status.ExperimentStatus`. Conditions follow
metav1.Condition: one entry per type, `observedGeneration` set to the object's
generation, `lastTransitionTime` kept while the condition's `status` does not change.

Phases: Pending (not placed), Scheduled (bound, engine not yet reporting), Running,
Suspended, Succeeded, Failed. Succeeded and Failed are terminal and sticky.

Besides one condition per phase, both kinds carry the three conditions generic tools
read (kstatus, `kubectl wait --for=condition=Ready`, Argo CD, Flux): `Reconciling`
(True while the operator is still getting it where it should be), `Stalled` (True when
it cannot get there without a human) and `Ready`. An experiment is a job-like
resource, so `Ready` is True while it trains normally and once it has succeeded (as
kstatus counts a running or complete Job as current); a suspended experiment is at
rest, neither reconciling nor stalled, and not Ready.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from loraplex_operator import engine_failures as ef
from loraplex_operator import idle, versions
from loraplex_operator.api.condition import Condition
from loraplex_operator.api.status import (
    CheckpointStatus,
    EnginePoolStatus,
    ExperimentStatus,
    InstalledPlugins,
)
from loraplex_operator.config import DEFAULT_MAX_RESTARTS
from loraplex_operator.placement import WAIT_UNSCHEDULABLE
from loraplex_operator.resources import Experiment

PENDING, SCHEDULED, RUNNING = "Pending", "Scheduled", "Running"
SUSPENDED, SUCCEEDED, FAILED = "Suspended", "Succeeded", "Failed"
EXPERIMENT_PHASES = (PENDING, SCHEDULED, RUNNING, SUSPENDED, SUCCEEDED, FAILED)
TERMINAL = frozenset({SUCCEEDED, FAILED})

# Condition types, in the order they are written.
ADMITTED, COND_SCHEDULED, COND_RUNNING = "Admitted", "Scheduled", "Running"
COND_SUSPENDED, COND_SUCCEEDED, COND_FAILED = "Suspended", "Succeeded", "Failed"
# The generic (kstatus) conditions, written on both kinds.
READY, RECONCILING, STALLED = "Ready", "Reconciling", "Stalled"
CONDITION_TYPES = (
    READY,
    RECONCILING,
    STALLED,
    ADMITTED,
    COND_SCHEDULED,
    COND_RUNNING,
    COND_SUSPENDED,
    COND_SUCCEEDED,
    COND_FAILED,
)

# The condition whose reason says why an experiment is in each phase.
_PHASE_CONDITION = {
    PENDING: COND_SCHEDULED,  # NoCapacity, WaitingForEngine, AdmissionFailed, Preempted, ...
    SCHEDULED: COND_SCHEDULED,  # Bound
    RUNNING: COND_RUNNING,  # Training
    SUSPENDED: COND_SUSPENDED,  # SuspendRequested, IdleTimeout (idle.py)
    SUCCEEDED: COND_SUCCEEDED,  # MaxStepsReached
    FAILED: COND_FAILED,  # EngineReportedFailure, RestartBudgetExhausted
}
_REASON = re.compile(r"[A-Za-z][A-Za-z0-9]{0,63}")
# metav1.Condition's limit: a longer message (an engine's traceback) is cut, not refused.
MAX_MESSAGE = 32768


@dataclass(frozen=True)
class Binding:
    """Where the operator placed the experiment."""

    engine: str
    node: str | None = None


@dataclass(frozen=True)
class Observation:
    """Everything status depends on, gathered by the handler."""

    binding: Binding | None = None
    engine_status: Mapping[str, Any] | None = None  # GET /v1/experiments/{id} body
    problems: Sequence[str] = ()  # admission problems, "field: message"
    waiting_reason: str | None = None  # placement.Wait reason while pending
    waiting_message: str | None = None  # what that reason is about (an engine's failure)
    restarts: int = 0
    max_restarts: int = DEFAULT_MAX_RESTARTS


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, status: bool | None, reason: str, message: str = "") -> dict[str, Any]:
    """A condition as wanted now, without generation or time (set by `merge_conditions`)."""
    value = "Unknown" if status is None else ("True" if status else "False")
    return {"type": type_, "status": value, "reason": reason, "message": message[:MAX_MESSAGE]}


def merge_conditions(
    old: Sequence[Condition] | None,
    new: Sequence[Mapping[str, Any]],
    generation: int,
    now: datetime,
) -> tuple[Condition, ...]:
    """New conditions with lastTransitionTime kept from `old` where the status is unchanged.

    Types in `old` but not in `new` are kept as they were (another writer may own them).
    """
    previous = {c.type: c for c in old or ()}
    merged: list[Condition] = []
    for cond in new:
        before = previous.pop(cond["type"], None)
        when = rfc3339(now)
        if before is not None and before.status == cond["status"] and before.last_transition_time:
            when = before.last_transition_time
        stamped = {**cond, "observedGeneration": generation, "lastTransitionTime": when}
        merged.append(Condition.model_validate(stamped))
    merged.extend(previous.values())
    return tuple(merged)


def get_condition(
    conditions: Sequence[Mapping[str, Any]] | None, type_: str
) -> Mapping[str, Any] | None:
    """A condition of a status as read (`resources.Experiment.status`), by type."""
    return next((c for c in conditions or () if c.get("type") == type_), None)


def is_true(conditions: Sequence[Mapping[str, Any]] | None, type_: str) -> bool:
    cond = get_condition(conditions, type_)
    return cond is not None and cond.get("status") == "True"


# --- phase -----------------------------------------------------------------------------


IDLE_MESSAGE = (
    "suspended after no call for spec.client.idleSeconds: checkpointed and unloaded; its "
    "client's next call through the gateway resumes it"
)


@dataclass(frozen=True)
class _Verdict:
    phase: str
    reason: str
    message: str


def _verdict(suspend: bool, old_phase: str | None, obs: Observation) -> _Verdict:
    engine = obs.engine_status or {}
    engine_phase = engine.get("phase")
    if old_phase in TERMINAL:
        return _Verdict(old_phase, "Terminal", f"experiment already {old_phase.lower()}")
    if engine_phase == FAILED:
        return _Verdict(
            FAILED, "EngineReportedFailure", str(engine.get("error") or "engine reported failure")
        )
    if engine_phase == SUCCEEDED:
        return _Verdict(SUCCEEDED, "MaxStepsReached", f"finished at step {engine.get('step', 0)}")
    if obs.restarts > obs.max_restarts:
        msg = f"restarted {obs.restarts} times (budget {obs.max_restarts})"
        return _Verdict(FAILED, "RestartBudgetExhausted", msg)
    if suspend:
        return _Verdict(SUSPENDED, "SuspendRequested", "suspended: checkpointed and unloaded")
    if obs.problems:
        return _Verdict(PENDING, "AdmissionFailed", "; ".join(obs.problems))
    if obs.binding is None:
        reason = obs.waiting_reason or "WaitingForPlacement"
        message = f"waiting for placement ({reason})"
        return _Verdict(
            PENDING, reason, f"{message}: {obs.waiting_message}" if obs.waiting_message else message
        )
    if engine_phase == RUNNING:
        return _Verdict(RUNNING, "Training", f"training on {obs.binding.engine}")
    return _Verdict(SCHEDULED, "Bound", f"bound to {obs.binding.engine}")


# Pending for one of these reasons needs a human (fix the spec or the pool): Stalled.
# The engine pod failures among them: its engine cannot start until the pool is fixed.
NEEDS_A_HUMAN = frozenset(
    {"AdmissionFailed", WAIT_UNSCHEDULABLE, *ef.WAITING, ef.OOM_KILLED, ef.NOT_READY}
)


def generic_conditions(phase: str, reason: str, message: str) -> list[dict[str, Any]]:
    """Ready, Reconciling and Stalled of an experiment in `phase` for `reason` (kstatus)."""
    stalled = phase == FAILED or (phase == PENDING and reason in NEEDS_A_HUMAN)
    reconciling = phase in (PENDING, SCHEDULED) and not stalled
    return [
        condition(READY, phase in (RUNNING, SUCCEEDED), reason, message),
        _flag(RECONCILING, reconciling, reason, message),
        _flag(STALLED, stalled, reason, message),
    ]


def _flag(type_: str, on: bool, reason: str, message: str) -> dict[str, Any]:
    """An abnormal-true condition: the reason and message when True, `Not<Type>` when False."""
    return condition(type_, on, reason if on else f"Not{type_}", message if on else "")


def _conditions_for(v: _Verdict, obs: Observation) -> list[dict[str, Any]]:
    admitted = not obs.problems
    placed = v.phase in (SCHEDULED, RUNNING) or (v.phase in TERMINAL and obs.binding is not None)
    return [
        *generic_conditions(v.phase, v.reason, v.message),
        condition(
            ADMITTED,
            admitted,
            "Admitted" if admitted else "AdmissionFailed",
            "" if admitted else "; ".join(obs.problems),
        ),
        condition(
            COND_SCHEDULED,
            placed,
            "Bound" if placed else v.reason,
            f"bound to {obs.binding.engine}" if placed and obs.binding else v.message,
        ),
        condition(COND_RUNNING, v.phase == RUNNING, v.reason, v.message),
        condition(
            COND_SUSPENDED,
            v.phase == SUSPENDED,
            v.reason if v.phase == SUSPENDED else "NotSuspended",
        ),
        condition(
            COND_SUCCEEDED,
            v.phase == SUCCEEDED,
            v.reason if v.phase == SUCCEEDED else "NotSucceeded",
        ),
        condition(
            COND_FAILED,
            v.phase == FAILED,
            v.reason if v.phase == FAILED else "NotFailed",
            v.message if v.phase == FAILED else "",
        ),
    ]


# --- the status patch ------------------------------------------------------------------

# Progress carried over from the status written last (the engine may not report it now).
_CARRIED = (
    "step",
    "reward",
    "checkpoint",
    "adapter_path",
    "started_at",
    "eval_step",
    "eval_reward",
    "eval_pass_at_k",
    "versions",
    "aliases",
    "publish_request_token",
)
# The latest eval (spec.eval) the engine reports, engine key -> status field.
_EVAL_FIELDS = {"evalReward": "eval_reward", "evalPassAtK": "eval_pass_at_k"}


def _engine_fields(engine: Mapping[str, Any]) -> dict[str, Any]:
    """The progress the engine reports (GET /v1/experiments/{id}), as status fields."""
    out: dict[str, Any] = {}
    if "step" in engine:
        out["step"] = int(engine["step"])
    if engine.get("reward") is not None:
        out["reward"] = float(engine["reward"])
    ckpt = engine.get("checkpoint")
    if ckpt:
        out["checkpoint"] = CheckpointStatus(path=ckpt["path"], step=int(ckpt["step"]))
    if engine.get("adapterPath"):
        out["adapter_path"] = engine["adapterPath"]
    if engine.get("startedAt"):
        out["started_at"] = engine["startedAt"]
    if engine.get("evalStep") is not None:
        out["eval_step"] = int(engine["evalStep"])
    for key, name in _EVAL_FIELDS.items():
        if engine.get(key) is not None:
            out[name] = float(engine[key])
    return out | versions.status_fields(engine)


def derive_status(exp: Experiment, obs: Observation, now: datetime) -> ExperimentStatus:
    """The full `status` for the experiment `exp` given `obs` (patch its `to_patch()`)."""
    old = ExperimentStatus.model_validate(exp.raw_status)
    generation = exp.meta.generation
    if old.phase in TERMINAL:
        return _terminal(old, generation, now, exp.spec.algorithm.max_steps)
    verdict = _verdict(exp.spec.suspend, old.phase, obs)
    if verdict.reason == "SuspendRequested" and idle.idle_suspended(exp.raw):
        verdict = _Verdict(SUSPENDED, "IdleTimeout", IDLE_MESSAGE)

    # Only fields set: one never written stays out of the patch, as it was.
    fields = {k: getattr(old, k) for k in _CARRIED if k in old.model_fields_set}
    fields.update(_engine_fields(obs.engine_status or {}))
    fields.update(
        phase=verdict.phase,
        message=verdict.message,
        observed_generation=generation,
        restarts=obs.restarts,
    )
    published = versions.published_condition(
        exp.raw_spec,
        fields.get("aliases"),
        (obs.engine_status or {}).get("publishError"),
        fields.get("versions") or (),
    )
    new_conditions = [*_conditions_for(verdict, obs), *([published] if published else [])]
    fields["conditions"] = merge_conditions(old.conditions, new_conditions, generation, now)
    if obs.binding is not None and verdict.phase != SUSPENDED:
        fields["engine"] = obs.binding.engine
        if obs.binding.node:
            fields["node"] = obs.binding.node
    else:
        fields.update(engine=None, node=None)  # set to None: the merge patch removes them
    fields["progress"] = progress(fields.get("step"), exp.spec.algorithm.max_steps)
    if verdict.phase == RUNNING and "started_at" not in fields:
        fields["started_at"] = rfc3339(now)
    if verdict.phase in TERMINAL:
        fields["completed_at"] = rfc3339(now)
    return ExperimentStatus(**fields)


def progress(step: int | None, max_steps: int) -> str:
    """`status.progress`: steps done of maxSteps ("12/50"; continual, maxSteps 0: "12/-")."""
    return f"{step or 0}/{max_steps if max_steps > 0 else '-'}"


def _terminal(
    old: ExperimentStatus, generation: int, now: datetime, max_steps: int
) -> ExperimentStatus:
    """A finished experiment's status stays as it was; one written before the generic
    conditions or the progress existed gets them (from its phase and that phase's reason,
    from its step)."""
    update: dict[str, Any] = {"observed_generation": generation}
    if old.progress is None:
        update["progress"] = progress(old.step, max_steps)
    if old.condition(READY) is None:
        new = generic_conditions(str(old.phase), phase_reason(old), old.message or "")
        update["conditions"] = merge_conditions(old.conditions, new, generation, now)
    return old.model_copy(update=update)


def phase_reason(status: ExperimentStatus) -> str:
    """Why the experiment is in its phase, as one CamelCase word: the reason of the
    condition that explains the phase (see `_PHASE_CONDITION`). The reasons come from a
    fixed set written by this module, which makes them fit for a metric label; anything
    else (no condition, a hand-written status) is "Unknown"."""
    cond = status.condition(_PHASE_CONDITION.get(status.phase or "", ""))
    reason = cond.reason if cond is not None else ""
    return reason if _REASON.fullmatch(reason) else "Unknown"


# --- EnginePool ------------------------------------------------------------------------

CAPACITY_PENDING = "CapacityPending"
STORAGE_FULL = "StorageFull"
CHECKPOINT_VOLUME_FULL = "CheckpointVolumeFull"
WAITING_FOR_ADMISSION = "WaitingForAdmission"  # engine pod gated (Kueue has not admitted it)
POD_UNSCHEDULABLE = "Unschedulable"  # engine pod fits no node (yet)
_POOL_RECONCILING = frozenset({"EnginesStarting", WAITING_FOR_ADMISSION, POD_UNSCHEDULABLE})


@dataclass(frozen=True)
class PoolObservation:
    """What a pool's status is derived from: its engine pods, counted."""

    engines: int  # pods that count: neither failed nor being deleted
    ready: int  # of those, ready and answering
    slots_used: int
    slots_free: int
    min_replicas: int = 0
    gated: Sequence[str] = ()  # pods held by a scheduling gate (Kueue: not admitted yet)
    unschedulable: Sequence[str] = ()  # pods the scheduler found no node for
    token_found: bool = True  # the engine token Secret exists (engines cannot start without)
    # (engine pod, why) of the engines whose checkpoints wait for room on a full volume
    # (their /v1/capacity `storageFull`).
    storage_full: Sequence[tuple[str, str]] = ()
    # Engine pods that cannot serve and will not by themselves (engine_failures).
    failures: Sequence[ef.PodFailure] = ()
    # The plug-ins a ready engine reports (/v1/capacity `plugins`); None: none ready.
    plugins: Mapping[str, Any] | None = None
    paging: PoolPaging | None = None  # registered and paged adapters of the ready engines


@dataclass(frozen=True)
class PoolPaging:
    """Adapters the ready engines register, and how many of them are paged out
    (docs/design/paging.md); an engine that does not page counts its slots."""

    registered_used: int = 0
    registered_free: int = 0
    paged_adapters: int = 0
    spilled_adapters: int = 0
    paged_host_bytes: int = 0


def _capacity_pending(obs: PoolObservation) -> dict[str, Any]:
    """Engine pods asked for but not placed on a node: why, naming them."""
    if obs.gated:
        message = f"engine pods waiting for admission (scheduling gate): {', '.join(obs.gated)}"
        return condition(CAPACITY_PENDING, True, WAITING_FOR_ADMISSION, message)
    if obs.unschedulable:
        message = f"engine pods no node can take yet: {', '.join(obs.unschedulable)}"
        return condition(CAPACITY_PENDING, True, POD_UNSCHEDULABLE, message)
    return condition(CAPACITY_PENDING, False, "CapacityAvailable")


def _storage_full(obs: PoolObservation) -> dict[str, Any]:
    """Engines whose checkpoints wait for room on a full checkpoint volume: which, and
    what the engine said (each distinct reason once; the volume is usually shared)."""
    if not obs.storage_full:
        return condition(STORAGE_FULL, False, "CheckpointsWritten")
    pods = ", ".join(pod for pod, _ in obs.storage_full)
    reasons = "; ".join(dict.fromkeys(why for _, why in obs.storage_full))
    message = f"checkpoints deferred on engine pods {pods}: {reasons}"
    return condition(STORAGE_FULL, True, CHECKPOINT_VOLUME_FULL, message)


def _pool_stalled(obs: PoolObservation, counts: str) -> tuple[str, str] | None:
    """(reason, message) when the pool needs a human, else None."""
    if not obs.token_found:
        return "TokenSecretMissing", "engine token Secret (spec.tokenSecretRef) not found"
    if obs.failures:  # the first pod's reason; the message names every failing pod
        return obs.failures[0].reason, f"{counts}; " + "; ".join(f.describe() for f in obs.failures)
    return None


def pool_conditions(obs: PoolObservation) -> list[dict[str, Any]]:
    """Ready, Reconciling, Stalled, CapacityPending and StorageFull of a pool.

    Reconciling while engine pods are asked for but not ready (starting, gated,
    unschedulable) or fewer than `replicas.min` are ready; Stalled when the token Secret
    is missing (no engine starts until someone creates it) or an engine pod fails in a
    way that waiting does not fix (`engine_failures`: CrashLoopBackOff, ImagePullBackOff,
    OOMKilled, ...; the reason is the first failing pod's, the message names each pod,
    container and its last message); Ready when neither holds
    (some engine ready, or none wanted: a pool scaled to zero is at rest). StorageFull
    while an engine's checkpoints wait for room: they train on, so the pool stays Ready."""
    pending = _capacity_pending(obs)
    counts = f"{obs.ready}/{obs.engines} engines ready"
    stall = _pool_stalled(obs, counts)
    if stall is not None:
        why, message = stall
    elif obs.engines > obs.ready or obs.ready < obs.min_replicas:
        on_hold = pending["status"] == "True"
        why = pending["reason"] if on_hold else "EnginesStarting"
        message = f"{counts}; {pending['message']}" if on_hold else counts
    else:
        why, message = ("EnginesReady" if obs.ready else "ScaledToZero"), counts
    stalled = stall is not None
    reconciling = not stalled and why in _POOL_RECONCILING
    return [
        condition(READY, not (stalled or reconciling), why, message),
        _flag(RECONCILING, reconciling, why, message),
        _flag(STALLED, stalled, why, message),
        pending,
        _storage_full(obs),
    ]


def _paging_status(paging: PoolPaging | None) -> dict[str, int]:
    """EnginePoolStatus fields of the pool's paging counts (none until they are known)."""
    return {} if paging is None else asdict(paging)


def pool_status(
    obs: PoolObservation,
    generation: int,
    old_conditions: Sequence[Condition] | None,
    now: datetime,
) -> EnginePoolStatus:
    """EnginePool status: the counts and the conditions of `pool_conditions`."""
    return EnginePoolStatus(
        observed_generation=generation,
        engines=obs.engines,
        ready=obs.ready,
        slots_used=obs.slots_used,
        slots_free=obs.slots_free,
        **_paging_status(obs.paging),
        plugins=None if obs.plugins is None else InstalledPlugins.model_validate(obs.plugins),
        conditions=merge_conditions(old_conditions, pool_conditions(obs), generation, now),
    )
