"""Semantic admission of a LoRAExperiment against its EnginePool (pure, no I/O).

The CRD schema and its CEL rules reject malformed objects at the API server; these
checks need the pool (and the namespace's labels), so the operator runs them and
reports the problems on the experiment's `Admitted` condition and as an Event.
Each problem names the field it is about.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loraplex_operator import client_ids, client_modules
from loraplex_operator.api.pool import EnginePoolSpec, LabelSelector, LabelSelectorRequirement
from loraplex_operator.api.priority import DEFAULT_CLASS, PriorityClass, class_of, find_class
from loraplex_operator.placement import adapter_memory_bytes
from loraplex_operator.resources import (
    DEFAULT_TARGET_CANDIDATES,
    Experiment,
    ExperimentSpec,
    Pool,
)


@dataclass(frozen=True)
class Problem:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def selector_matches(selector: LabelSelector, labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector semantics (an empty selector matches everything)."""
    for key, value in (selector.match_labels or {}).items():
        if labels.get(key) != value:
            return False
    return all(_expression_matches(e, labels) for e in selector.match_expressions or ())


def _expression_matches(expr: LabelSelectorRequirement, labels: Mapping[str, str]) -> bool:
    key, op, values = expr.key, expr.operator, expr.values or ()
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    return False


def namespace_allowed(
    pool: EnginePoolSpec, namespace: str, namespace_labels: Mapping[str, str] | None
) -> bool:
    """Listed or selected; a pool with neither list nor selector admits every namespace."""
    listed, selector = pool.allowed_namespaces, pool.namespace_selector
    if listed is None and selector is None:
        return True
    if listed and namespace in listed:
        return True
    return selector is not None and selector_matches(selector, namespace_labels or {})


def experiment_memory_bytes(
    exp: ExperimentSpec, pool: EnginePoolSpec, slot_bytes: int | None = None
) -> int:
    """The memory an experiment costs an engine of this pool: ``slot_bytes`` where the
    engines report it (observation.slot_bytes: 0 while none has answered), else the
    adapter estimate from the pool's model shape (0 without one). Either is one rank's
    cost: a multi-rank engine holds a replica of every slot on each rank, and memoryBytes
    is a per-rank budget, so the world size changes neither side."""
    if slot_bytes is not None:
        return slot_bytes
    # Unset targets are sized as q_proj + v_proj: the family default, and an upper bound
    # for Phi-3's qkv_proj (rank × (2h + 2kv) ≤ rank × (3h + kv) since kv ≤ h).
    targets = exp.lora.target_modules or DEFAULT_TARGET_CANDIDATES[0]
    return adapter_memory_bytes(exp.lora.rank, targets, pool.model_shape)


def check_experiment(
    experiment: Experiment,
    pool: Pool | None,
    namespace_labels: Mapping[str, str] | None = None,
    slot_bytes: int | None = None,
    wrapped: frozenset[str] | None = None,
) -> list[Problem]:
    """Problems that keep `experiment` off `pool` (None = the named pool does not exist);
    ``slot_bytes``: as for ``experiment_memory_bytes``; ``wrapped``: the modules the
    pool's engines wrap (observation.wrapped_modules; None: not known yet)."""
    pool_name = experiment.spec.engine_pool
    if pool is None:
        return [Problem("spec.enginePool", f"EnginePool {pool_name!r} not found")]
    namespace = experiment.meta.namespace
    problems: list[Problem] = []
    if not namespace_allowed(pool.spec, namespace, namespace_labels):
        problems.append(
            Problem(
                "metadata.namespace",
                f"namespace {namespace!r} may not use EnginePool {pool_name!r}",
            )
        )
    problems.extend(_priority_problems(experiment.spec, pool.spec, pool_name, namespace))
    problems.extend(_lora_problems(experiment.spec, pool.spec, pool_name))
    client = experiment.raw_spec.get("client")
    if isinstance(client, Mapping) and (why := client_ids.problem(experiment.meta.name, client)):
        problems.append(Problem("spec.client.modelId", why))
    if isinstance(client, Mapping) and wrapped is not None:
        allowed = pool.spec.allowed_target_modules
        for field, _, extra in client_modules.refused(client, wrapped, allowed):
            message = client_modules.message(pool_name, extra, allowed, field)
            problems.append(Problem(f"spec.client.{field}", message))
    problems.extend(_memory_problems(experiment.spec, pool.spec, pool_name, slot_bytes))
    return problems


def priority_class(experiment: Experiment, pool: EnginePoolSpec) -> PriorityClass:
    """The class an experiment counts at: the one it names, or the default class (value 0)
    where it names none or one it may not use (only a placed experiment, which admission
    let in under an older pool, is ever asked for the latter: as a victim it has value 0)."""
    spec = experiment.spec
    found = class_of(pool.priority_classes, spec.priority_class_name, experiment.meta.namespace)
    return found or DEFAULT_CLASS


def _priority_problems(
    exp: ExperimentSpec, pool: EnginePoolSpec, pool_name: str, namespace: str
) -> list[Problem]:
    """The class named must be the pool's and this namespace's to use; a raw priority other
    than 0 is refused, not ignored, so its author learns it no longer counts."""
    problems: list[Problem] = []
    names = [c.name for c in pool.priority_classes or ()]
    defined = f"it defines {', '.join(names)}" if names else "it defines none"
    if exp.priority not in (None, 0):
        problems.append(
            Problem(
                "spec.priority",
                f"{exp.priority} is no longer honoured: priorities are EnginePool {pool_name!r}'s "
                f"classes ({defined}); remove spec.priority and name one in "
                "spec.priorityClassName",
            )
        )
    name = exp.priority_class_name
    if name is None:
        return problems
    found = find_class(pool.priority_classes, name)
    if found is None:
        message = f"priority class {name!r} is not defined by EnginePool {pool_name!r} ({defined})"
        problems.append(Problem("spec.priorityClassName", message))
    elif not found.allows(namespace):
        problems.append(
            Problem(
                "spec.priorityClassName",
                f"namespace {namespace!r} may not use priority class {name!r} of EnginePool "
                f"{pool_name!r}",
            )
        )
    return problems


def _lora_problems(exp: ExperimentSpec, pool: EnginePoolSpec, pool_name: str) -> list[Problem]:
    problems: list[Problem] = []
    rank, max_rank = exp.lora.rank, pool.capacity.max_rank
    if rank > max_rank:
        problems.append(
            Problem(
                "spec.lora.rank",
                f"rank {rank} exceeds EnginePool {pool_name!r} max rank {max_rank}",
            )
        )
    allowed = pool.allowed_target_modules
    if exp.client:  # modules by kind (spec.client.trainAttn...): check_experiment's
        return problems
    if exp.lora.target_modules is None:
        problems += _default_targets_problems(allowed, pool_name)
        return problems
    extra = _unlisted(exp.lora.target_modules, allowed)
    if extra:
        problems.append(
            Problem(
                "spec.lora.targetModules",
                f"{', '.join(extra)} not allowed by EnginePool {pool_name!r} "
                f"(allowed: {', '.join(allowed)})",
            )
        )
    return problems


def _default_targets_problems(allowed: Sequence[str], pool_name: str) -> list[Problem]:
    """No targetModules: the engine picks one of the family defaults; the pool must allow
    one of them whole (which one depends on the base model, unknown here)."""
    if any(set(c) <= set(allowed) for c in DEFAULT_TARGET_CANDIDATES):
        return []
    defaults = " or ".join("+".join(c) for c in DEFAULT_TARGET_CANDIDATES)
    return [
        Problem(
            "spec.lora.targetModules",
            f"unset, so the family default ({defaults}) applies, which EnginePool "
            f"{pool_name!r} does not allow (allowed: {', '.join(allowed)}); name the targets",
        )
    ]


def _unlisted(wanted: Sequence[str], allowed: Sequence[str]) -> list[str]:
    return sorted(set(wanted) - set(allowed))


def _memory_problems(
    exp: ExperimentSpec, pool: EnginePoolSpec, pool_name: str, slot_bytes: int | None
) -> list[Problem]:
    budget = pool.capacity.memory_bytes
    need = experiment_memory_bytes(exp, pool, slot_bytes)
    if not budget or need <= budget:
        return []
    if slot_bytes:  # the engines' own figure: no rank of this experiment changes it
        return [
            Problem(
                "spec.enginePool",
                f"an adapter slot of EnginePool {pool_name!r} takes {need} bytes (the engines "
                f"allocate every slot at max rank {pool.capacity.max_rank}), more than its "
                f"memory budget per engine ({budget})",
            )
        ]
    return [
        Problem(
            "spec.lora.rank",
            f"adapter needs about {need} bytes, more than EnginePool {pool_name!r} "
            f"memory budget per engine ({budget})",
        )
    ]
