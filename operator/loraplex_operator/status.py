"""Status derivation for LoRAExperiment (pure, no I/O).

`derive_status()` turns what the operator observed — the object, its binding, the
engine's experiment status (docs/engine-api.md), admission problems, restarts — into
the `status` dict to patch. Conditions follow metav1.Condition: one entry per type,
`observedGeneration` set to the object's generation, `lastTransitionTime` kept while
the condition's `status` does not change.

Phases: Pending (not placed), Scheduled (bound, engine not yet reporting), Running,
Suspended, Succeeded, Failed. Succeeded and Failed are terminal and sticky.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from loraplex_operator.config import DEFAULT_MAX_RESTARTS
from loraplex_operator.resources import Experiment

PENDING, SCHEDULED, RUNNING = "Pending", "Scheduled", "Running"
SUSPENDED, SUCCEEDED, FAILED = "Suspended", "Succeeded", "Failed"
EXPERIMENT_PHASES = (PENDING, SCHEDULED, RUNNING, SUSPENDED, SUCCEEDED, FAILED)
TERMINAL = frozenset({SUCCEEDED, FAILED})

# Condition types, in the order they are written.
ADMITTED, COND_SCHEDULED, COND_RUNNING = "Admitted", "Scheduled", "Running"
COND_SUSPENDED, COND_SUCCEEDED, COND_FAILED = "Suspended", "Succeeded", "Failed"
CONDITION_TYPES = (
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
    SUSPENDED: COND_SUSPENDED,  # SuspendRequested
    SUCCEEDED: COND_SUCCEEDED,  # MaxStepsReached
    FAILED: COND_FAILED,  # EngineReportedFailure, RestartBudgetExhausted
}
_REASON = re.compile(r"[A-Za-z][A-Za-z0-9]{0,63}")


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
    restarts: int = 0
    max_restarts: int = DEFAULT_MAX_RESTARTS


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, status: bool | None, reason: str, message: str = "") -> dict[str, Any]:
    """A condition without generation or time (set by `merge_conditions`)."""
    value = "Unknown" if status is None else ("True" if status else "False")
    return {"type": type_, "status": value, "reason": reason, "message": message}


def merge_conditions(
    old: Sequence[Mapping[str, Any]] | None,
    new: Sequence[Mapping[str, Any]],
    generation: int,
    now: datetime,
) -> list[dict[str, Any]]:
    """New conditions with lastTransitionTime kept from `old` where the status is unchanged.

    Types in `old` but not in `new` are kept as they were (another writer may own them).
    """
    previous = {c["type"]: c for c in old or ()}
    merged: list[dict[str, Any]] = []
    for cond in new:
        before = previous.pop(cond["type"], None)
        same = before is not None and before.get("status") == cond["status"]
        when = (
            before["lastTransitionTime"]
            if same and before.get("lastTransitionTime")
            else rfc3339(now)
        )
        merged.append({**cond, "observedGeneration": generation, "lastTransitionTime": when})
    merged.extend(dict(c) for c in previous.values())
    return merged


def get_condition(
    conditions: Sequence[Mapping[str, Any]] | None, type_: str
) -> Mapping[str, Any] | None:
    return next((c for c in conditions or () if c.get("type") == type_), None)


def is_true(conditions: Sequence[Mapping[str, Any]] | None, type_: str) -> bool:
    cond = get_condition(conditions, type_)
    return cond is not None and cond.get("status") == "True"


# --- phase -----------------------------------------------------------------------------


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
        return _Verdict(PENDING, reason, f"waiting for placement ({reason})")
    if engine_phase == RUNNING:
        return _Verdict(RUNNING, "Training", f"training on {obs.binding.engine}")
    return _Verdict(SCHEDULED, "Bound", f"bound to {obs.binding.engine}")


def _conditions_for(v: _Verdict, obs: Observation) -> list[dict[str, Any]]:
    admitted = not obs.problems
    placed = v.phase in (SCHEDULED, RUNNING) or (v.phase in TERMINAL and obs.binding is not None)
    return [
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


def _engine_fields(engine: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "step" in engine:
        out["step"] = int(engine["step"])
    if engine.get("reward") is not None:
        out["reward"] = float(engine["reward"])
    ckpt = engine.get("checkpoint")
    if ckpt:
        out["checkpoint"] = {"path": ckpt["path"], "step": int(ckpt["step"])}
    if engine.get("adapterPath"):
        out["adapterPath"] = engine["adapterPath"]
    if engine.get("startedAt"):
        out["startedAt"] = engine["startedAt"]
    return out


def derive_status(exp: Experiment, obs: Observation, now: datetime) -> dict[str, Any]:
    """The full `status` for the experiment `exp` given `obs` (patch it as `status`)."""
    old = exp.raw_status  # carried over field by field: the status has no view of its own
    generation = exp.meta.generation
    verdict = _verdict(exp.spec.suspend, old.get("phase"), obs)
    if old.get("phase") in TERMINAL:
        return {**old, "observedGeneration": generation}

    status: dict[str, Any] = {
        k: old[k] for k in ("step", "reward", "checkpoint", "adapterPath", "startedAt") if k in old
    }
    status.update(_engine_fields(obs.engine_status or {}))
    status.update(
        phase=verdict.phase,
        message=verdict.message,
        observedGeneration=generation,
        restarts=obs.restarts,
        conditions=merge_conditions(
            old.get("conditions"), _conditions_for(verdict, obs), generation, now
        ),
    )
    if obs.binding is not None and verdict.phase != SUSPENDED:
        status["engine"] = obs.binding.engine
        if obs.binding.node:
            status["node"] = obs.binding.node
    else:
        status["engine"] = None  # merge-patch null removes a stale engine/node
        status["node"] = None
    if verdict.phase == RUNNING and "startedAt" not in status:
        status["startedAt"] = rfc3339(now)
    if verdict.phase in TERMINAL:
        status["completedAt"] = rfc3339(now)
    return status


def phase_reason(status: Mapping[str, Any]) -> str:
    """Why the experiment is in its phase, as one CamelCase word: the reason of the
    condition that explains the phase (see `_PHASE_CONDITION`). The reasons come from a
    fixed set written by this module, which makes them fit for a metric label; anything
    else (no condition, a hand-written status) is "Unknown"."""
    cond = get_condition(status.get("conditions"), _PHASE_CONDITION.get(status.get("phase"), ""))
    reason = str((cond or {}).get("reason") or "")
    return reason if _REASON.fullmatch(reason) else "Unknown"


def pool_status(
    engines: int,
    ready: int,
    slots_used: int,
    slots_free: int,
    generation: int,
    old_conditions: Sequence[Mapping[str, Any]] | None,
    now: datetime,
) -> dict[str, Any]:
    """EnginePool status: counts and a Ready condition (some engine ready)."""
    cond = condition(
        "Ready",
        ready > 0,
        "EnginesReady" if ready else "NoReadyEngine",
        f"{ready}/{engines} engines ready",
    )
    return {
        "observedGeneration": generation,
        "engines": engines,
        "ready": ready,
        "slotsUsed": slots_used,
        "slotsFree": slots_free,
        "conditions": merge_conditions(old_conditions, [cond], generation, now),
    }
