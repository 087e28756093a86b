"""``EnginePool.status``: what the operator observed, as a typed object (KubeRay's typed
status). ``status.pool_status`` builds it, the publisher patches its ``to_json()``, and
``scripts/gen_crds.py`` generates the CRD's status schema from it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loraplex_operator.api.schema import ApiModel, DateTime, Int32, Int64, list_map

ConditionStatus = Literal["True", "False", "Unknown"]
# metav1.Condition's reason: one CamelCase word (commas and colons allowed, as upstream).
REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


class PoolCondition(ApiModel):
    # No docstring: it would become the items' description, which the list's says.

    type: str = Field(
        max_length=316,
        description="The condition's type (Ready, Reconciling, Stalled, CapacityPending).",
    )
    status: ConditionStatus = Field(description="Whether the condition holds.")
    observed_generation: Int64 | None = Field(
        None,
        alias="observedGeneration",
        ge=0,
        description="The metadata.generation the condition was computed from.",
    )
    last_transition_time: DateTime = Field(
        alias="lastTransitionTime",
        description="When status last changed (kept while it stays the same).",
    )
    reason: str = Field(
        min_length=1,
        max_length=1024,
        pattern=REASON_PATTERN,
        description="Why, as one CamelCase word (EnginesReady, ScaledToZero, EnginesStarting, "
        "WaitingForAdmission, Unschedulable, TokenSecretMissing).",
    )
    message: str = Field(
        max_length=32768, description='Why, for people (e.g. "1/2 engines ready").'
    )


class EnginePoolStatus(ApiModel):
    """Observed state, written by the operator once per reconcile round."""

    observed_generation: Int64 | None = Field(
        None,
        alias="observedGeneration",
        description="The metadata.generation this status was computed from.",
    )
    engines: Int32 | None = Field(
        None,
        ge=0,
        description="Engine pods of the pool that count (neither failed nor being deleted).",
    )
    ready: Int32 | None = Field(
        None,
        ge=0,
        description="Of those, the ones that are ready and answering (model loaded).",
    )
    slots_used: Int32 | None = Field(
        None,
        alias="slotsUsed",
        ge=0,
        description="Adapter slots in use over the ready engines.",
    )
    slots_free: Int32 | None = Field(
        None,
        alias="slotsFree",
        ge=0,
        description="Adapter slots free over the ready engines.",
    )
    conditions: tuple[PoolCondition, ...] | None = Field(
        None,
        max_length=16,
        description="metav1.Condition list, one per type. Ready: True when the pool is "
        "neither Reconciling nor Stalled (some engine ready, or none wanted). Reconciling: "
        "True while engine pods are asked for but not ready (starting, gated, unschedulable) "
        "or fewer than replicas.min are ready. Stalled: True when the token Secret is "
        "missing. CapacityPending: True while engine pods have no node yet, reason "
        "WaitingForAdmission (a scheduling gate, e.g. Kueue) or Unschedulable, the message "
        "naming the pods.",
        json_schema_extra=list_map("type"),
    )


__all__ = ["REASON_PATTERN", "ConditionStatus", "EnginePoolStatus", "PoolCondition"]
