"""``metav1.Condition``, as both kinds' statuses carry it: one model, so the two CRDs'
``status.conditions`` schemas (``scripts/gen_crds.py``) and the operator's reading and
writing of them cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import Field

from loraplex_operator.api.schema import ApiModel, DateTime, Int64, list_map

ConditionStatus = Literal["True", "False", "Unknown"]
# metav1.Condition's type: a qualified name (an optional DNS-subdomain prefix and "/").
TYPE_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
# metav1.Condition's reason: one CamelCase word (commas and colons allowed, as upstream).
REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
MAX_CONDITIONS = 16


class Condition(ApiModel):
    # No docstring: it would become the items' description, which the list's says.

    type: str = Field(
        max_length=316,
        pattern=TYPE_PATTERN,
        description="The condition's type, e.g. Ready, Stalled or Admitted.",
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
        description="Why, as one CamelCase word (e.g. EnginesReady, AdmissionFailed, "
        "RestartBudgetExhausted).",
    )
    message: str = Field(max_length=32768, description="Why, for people (may be empty).")


def conditions_field(description: str) -> Any:
    """A status's ``conditions``: one entry per type (merged by type by the API server)."""
    return Field(
        None,
        max_length=MAX_CONDITIONS,
        description=description,
        json_schema_extra=list_map("type"),
    )


def find(conditions: Iterable[Condition] | None, type_: str) -> Condition | None:
    """The condition of type ``type_``, if there is one."""
    return next((c for c in conditions or () if c.type == type_), None)


__all__ = [
    "MAX_CONDITIONS",
    "REASON_PATTERN",
    "TYPE_PATTERN",
    "Condition",
    "ConditionStatus",
    "conditions_field",
    "find",
]
