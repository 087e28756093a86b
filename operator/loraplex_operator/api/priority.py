"""``EnginePool.spec.priorityClasses``: the priorities an experiment may ask for, set by the
pool's admin (after Kueue's WorkloadPriorityClass), and which one an experiment gets.

A tenant names a class (``LoRAExperiment.spec.priorityClassName``), never a number: the
admin decides each class's value, which namespaces may use it, and whether it may preempt
another namespace's experiments. The classes live on the pool, not in a cluster-scoped kind
of their own, so the operator needs no RBAC beyond what the chart grants it on pools.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from loraplex_operator.api.schema import DNS_LABEL, LIST_SET, ApiModel, Int32, Namespace

# Kubernetes' own bound for user-defined PriorityClass values (above it: system classes).
MAX_VALUE = 1_000_000_000
MAX_CLASSES = 64


class PriorityClass(ApiModel):
    """One priority an experiment of this pool may name."""

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL,  # as the experiment's spec.priorityClassName (tested)
        description="What an experiment names in spec.priorityClassName; unique in the pool.",
    )
    value: Int32 = Field(
        ge=-MAX_VALUE,
        le=MAX_VALUE,
        description="Higher is placed first and may preempt strictly lower values when the pool "
        "is full (within the experiment's namespace, or any with preemptOtherNamespaces). An "
        "experiment naming no class has value 0.",
    )
    namespaces: tuple[Namespace, ...] | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="Namespaces whose experiments may name this class; absent = every "
        "namespace. An empty list is refused (in allowedNamespaces it means none; here it "
        "would be read both ways). An experiment naming a class its namespace may not use is "
        "not placed.",
        json_schema_extra=LIST_SET,
    )
    preempt_other_namespaces: bool = Field(
        False,
        alias="preemptOtherNamespaces",
        description="true: an experiment of this class may preempt lower-valued experiments of "
        "other namespaces too. false (default): only of its own namespace, so a tenant's "
        "class never unloads another tenant's work.",
    )

    def allows(self, namespace: str) -> bool:
        return self.namespaces is None or namespace in self.namespaces


# What an experiment that names no class gets: value 0, its own namespace only.
DEFAULT_CLASS = PriorityClass(name="default", value=0)


def find_class(classes: Sequence[PriorityClass] | None, name: str) -> PriorityClass | None:
    return next((c for c in classes or () if c.name == name), None)


def class_of(
    classes: Sequence[PriorityClass] | None, name: str | None, namespace: str
) -> PriorityClass | None:
    """The class an experiment of ``namespace`` naming ``name`` gets: the default class for
    no name, None when the pool defines no such class or the namespace may not use it."""
    if name is None:
        return DEFAULT_CLASS
    found = find_class(classes, name)
    return found if found is not None and found.allows(namespace) else None


__all__ = ["DEFAULT_CLASS", "MAX_CLASSES", "MAX_VALUE", "PriorityClass", "class_of", "find_class"]
