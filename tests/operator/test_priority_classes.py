"""Admin-owned priorities: which class an experiment gets from its pool, what admission says
when it may not have one, and what a round does with classes across namespaces (pure)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from loraplex_operator import admission, placement
from loraplex_operator.api.pool import EnginePoolSpec
from loraplex_operator.api.priority import DEFAULT_CLASS, class_of
from loraplex_operator.planning import plan_round
from loraplex_operator.resources import Experiment, Pool
from loraplex_operator.round_plan import PREEMPT

from tests.support.builders import experiment, pool
from tests.support.crdkit import apply_defaults, schema_of
from tests.support.reconcile_inputs import CFG, engine, exp, snap


def _problems(exp_obj: dict[str, Any], pool_obj: dict[str, Any]) -> list[str]:
    e = Experiment.from_obj(apply_defaults(schema_of("LoRAExperiment"), exp_obj))
    p = Pool.from_obj(apply_defaults(schema_of("EnginePool"), pool_obj))
    return [str(x) for x in admission.check_experiment(e, p)]


CLASSES = pool().priority_class("high", 100, "team-a").priority_class("batch", -5)


# --- which class ------------------------------------------------------------------------


def test_no_class_named_is_the_default_class() -> None:
    spec = EnginePoolSpec.from_obj(CLASSES.obj()["spec"])
    assert class_of(spec.priority_classes, None, "team-b") == DEFAULT_CLASS
    assert (DEFAULT_CLASS.value, DEFAULT_CLASS.preempt_other_namespaces) == (0, False)
    assert _problems(experiment("a").obj(), CLASSES.obj()) == []


def test_a_class_listed_for_the_namespace_or_for_every_namespace() -> None:
    spec = EnginePoolSpec.from_obj(CLASSES.obj()["spec"])
    assert class_of(spec.priority_classes, "high", "team-a").value == 100
    assert class_of(spec.priority_classes, "batch", "team-z").value == -5  # no list: all
    assert class_of(spec.priority_classes, "high", "team-b") is None
    assert class_of(spec.priority_classes, "nope", "team-a") is None
    assert _problems(experiment("a").priority_class("high").obj(), CLASSES.obj()) == []


def test_unknown_class_is_not_admitted_naming_class_and_pool() -> None:
    problems = _problems(experiment("a").priority_class("urgent").obj(), CLASSES.obj())
    assert problems == [
        "spec.priorityClassName: priority class 'urgent' is not defined by EnginePool "
        "'pool-a' (it defines high, batch)"
    ]
    bare = _problems(experiment("a").priority_class("urgent").obj(), pool().obj())
    assert bare and bare[0].endswith("(it defines none)")


def test_class_the_namespace_may_not_use_is_not_admitted_naming_both() -> None:
    obj = experiment("a", namespace="team-b").priority_class("high").obj()
    assert _problems(obj, CLASSES.obj()) == [
        "spec.priorityClassName: namespace 'team-b' may not use priority class 'high' of "
        "EnginePool 'pool-a'"
    ]


@pytest.mark.parametrize("value", [1, 10, -3])
def test_a_raw_priority_is_refused_not_ignored(value: int) -> None:
    # Stored before the CRD refused it (or past an API server without the rule): the
    # experiment waits with a message, rather than running at a priority it did not ask for.
    problems = _problems(experiment("a").priority(value).obj(), CLASSES.obj())
    assert len(problems) == 1 and problems[0].startswith(f"spec.priority: {value} is no longer")
    assert "priorityClassName" in problems[0] and "high, batch" in problems[0]


def test_a_raw_priority_of_zero_is_the_old_default_and_passes() -> None:
    assert _problems(experiment("a").priority(0).obj(), CLASSES.obj()) == []


def test_class_names_have_one_pattern_on_both_kinds() -> None:
    on_exp = schema_of("LoRAExperiment")["properties"]["spec"]["properties"]["priorityClassName"]
    on_pool = schema_of("EnginePool")["properties"]["spec"]["properties"]["priorityClasses"]
    on_pool = on_pool["items"]["properties"]["name"]
    keys = ("pattern", "minLength", "maxLength")
    assert [on_exp[k] for k in keys] == [on_pool[k] for k in keys]
    assert re.fullmatch(on_exp["pattern"].strip("^$"), "high-1")


# --- a round with classes ---------------------------------------------------------------


def _full_pool(*classes: tuple[str, int, tuple[str, ...], bool]) -> dict[str, Any]:
    p = pool().slots(1).replicas(0, 1)
    for name, value, namespaces, cross in classes:
        p = p.priority_class(name, value, *namespaces, cross=cross)
    return p.obj()


def _team_b_running() -> dict[str, Any]:
    obj = exp("low", phase="Running", engine="e1")
    obj["metadata"]["namespace"] = "team-b"
    return obj


def _team_a_high() -> dict[str, Any]:
    obj = exp("high", created=10)
    obj["spec"]["priorityClassName"] = "high"
    return obj


def _round(pool_obj: dict[str, Any]) -> Any:
    """team-b's experiment fills the pool's one slot; team-a's asks for class "high"."""
    engines = [engine("e1", "team-b.low", slots=1)]
    return plan_round(snap([_team_b_running(), _team_a_high()], engines, pool_obj), CFG)


def test_round_does_not_preempt_another_namespace_without_the_flag() -> None:
    p = _full_pool(("high", 100, ("team-a",), False))
    plan = _round(p)
    assert not [u for u in plan.unloads if u.reason == PREEMPT] and not plan.puts
    assert plan.work["team-a/high"].waiting_reason == placement.WAIT_NO_CAPACITY
    assert plan.work["team-a/high"].problems == []  # admitted: it just waits


def test_round_preempts_another_namespace_when_the_class_allows_it() -> None:
    p = _full_pool(("high", 100, ("team-a",), True))
    plan = _round(p)
    preempts = [u for u in plan.unloads if u.reason == PREEMPT]
    assert [(u.key, u.for_key) for u in preempts] == [("team-b/low", "team-a/high")]


def test_round_keeps_a_class_off_the_engines_for_a_namespace_not_allowed() -> None:
    p = _full_pool(("high", 100, ("team-c",), True))
    plan = _round(p)
    assert not plan.unloads and not plan.puts
    assert plan.work["team-a/high"].problems == [
        "spec.priorityClassName: namespace 'team-a' may not use priority class 'high' of "
        "EnginePool 'pool-a'"
    ]


def test_a_running_experiments_raw_priority_protects_it_no_more() -> None:
    # Placed before the upgrade with priority 50: as a victim it now counts at value 0.
    old = exp("old", phase="Running", engine="e1")
    old["spec"]["priority"] = 50
    p = _full_pool(("normal", 1, (), False))
    new = exp("new", created=10)
    new["spec"]["priorityClassName"] = "normal"
    plan = plan_round(snap([old, new], [engine("e1", "team-a.old", slots=1)], p), CFG)
    assert [(u.key, u.for_key) for u in plan.unloads] == [("team-a/old", "team-a/new")]


def test_a_running_experiment_whose_class_was_withdrawn_counts_at_zero() -> None:
    running = exp("vip", phase="Running", engine="e1")
    running["spec"]["priorityClassName"] = "gone"
    p = _full_pool(("normal", 1, (), False))
    new = exp("new", created=10)
    new["spec"]["priorityClassName"] = "normal"
    plan = plan_round(snap([running, new], [engine("e1", "team-a.vip", slots=1)], p), CFG)
    assert [(u.key, u.for_key) for u in plan.unloads] == [("team-a/vip", "team-a/new")]
