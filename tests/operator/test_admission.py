"""Semantic admission against the pool: each check names its field."""

from __future__ import annotations

from typing import Any

import pytest
from loraplex_operator import admission
from loraplex_operator.admission import Problem, experiment_memory_bytes, selector_matches
from loraplex_operator.api.pool import EnginePoolSpec, LabelSelector
from loraplex_operator.resources import Experiment, ExperimentSpec, Pool

from tests.support.builders import experiment, pool
from tests.support.crdkit import apply_defaults, schema_of


def _full(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    return apply_defaults(schema_of(kind), obj)


def check_experiment(
    exp: dict[str, Any], p: dict[str, Any] | None, labels: dict | None = None
) -> list[Problem]:
    """Admission of raw objects, through the views the operator builds of them."""
    pool_view = Pool.from_obj(p) if p is not None else None
    return admission.check_experiment(Experiment.from_obj(exp), pool_view, labels)


def _fields(exp: dict[str, Any], p: dict[str, Any] | None, labels: dict | None = None) -> list[str]:
    full_pool = _full("EnginePool", p) if p is not None else None
    return [x.field for x in check_experiment(_full("LoRAExperiment", exp), full_pool, labels)]


def test_admitted() -> None:
    assert _fields(experiment("a").obj(), pool().obj()) == []


def test_pool_not_found() -> None:
    problems = check_experiment(experiment("a").pool("nope").obj(), None)
    assert problems == [Problem("spec.enginePool", "EnginePool 'nope' not found")]


def test_rank_above_pool_max() -> None:
    problems = check_experiment(
        _full("LoRAExperiment", experiment("a").rank(128).alpha(128).obj()),
        _full("EnginePool", pool().max_rank(64).obj()),
    )
    assert [str(p) for p in problems] == [
        "spec.lora.rank: rank 128 exceeds EnginePool 'pool-a' max rank 64"
    ]


def test_rank_equal_to_pool_max_is_fine() -> None:
    assert _fields(experiment("a").rank(64).obj(), pool().max_rank(64).obj()) == []


@pytest.mark.parametrize(
    ("allowed", "selector", "labels", "ok"),
    [
        (None, None, {}, True),  # neither set: open pool
        (["team-a"], None, {}, True),
        (["team-b"], None, {}, False),
        ([], None, {}, False),  # an explicit empty list admits nobody
        (None, {"matchLabels": {"gpu": "yes"}}, {"gpu": "yes"}, True),
        (None, {"matchLabels": {"gpu": "yes"}}, {"gpu": "no"}, False),
        (["team-b"], {"matchLabels": {"gpu": "yes"}}, {"gpu": "yes"}, True),  # either admits
        (None, {}, {}, True),  # empty selector selects all
    ],
)
def test_namespace_allowed(
    allowed: list | None, selector: dict | None, labels: dict, ok: bool
) -> None:
    p = pool()
    if allowed is not None:
        p = p.allowed_namespaces(*allowed)
    if selector is not None:
        p = p.namespace_selector(selector)
    fields = _fields(experiment("a", namespace="team-a").obj(), p.obj(), labels)
    assert (fields == []) is ok
    if not ok:
        assert fields == ["metadata.namespace"]


@pytest.mark.parametrize(
    ("expr", "labels", "ok"),
    [
        ({"key": "tier", "operator": "In", "values": ["gold"]}, {"tier": "gold"}, True),
        ({"key": "tier", "operator": "In", "values": ["gold"]}, {}, False),
        ({"key": "tier", "operator": "NotIn", "values": ["gold"]}, {}, True),
        ({"key": "tier", "operator": "NotIn", "values": ["gold"]}, {"tier": "gold"}, False),
        ({"key": "tier", "operator": "Exists"}, {"tier": "x"}, True),
        ({"key": "tier", "operator": "DoesNotExist"}, {"tier": "x"}, False),
    ],
)
def test_selector_expressions(expr: dict, labels: dict, ok: bool) -> None:
    selector = LabelSelector.model_validate({"matchExpressions": [expr]})
    assert selector_matches(selector, labels) is ok


def test_target_modules_outside_pool_allowlist() -> None:
    exp = experiment("a").modules("q_proj", "lm_head", "embed_tokens").obj()
    problems = check_experiment(
        _full("LoRAExperiment", exp), _full("EnginePool", pool().target_modules("q_proj").obj())
    )
    assert [p.field for p in problems] == ["spec.lora.targetModules"]
    assert "embed_tokens, lm_head not allowed" in problems[0].message


def test_default_pool_allowlist_covers_llama_projections() -> None:
    exp = experiment("a").modules("q_proj", "k_proj", "v_proj", "o_proj", "down_proj").obj()
    assert _fields(exp, pool().obj()) == []


def test_unset_targets_need_a_family_default_in_the_pool_allowlist() -> None:
    exp = experiment("a").obj()  # no targetModules: q_proj+v_proj or qkv_proj, by family
    assert _fields(exp, pool().obj()) == []
    assert _fields(exp, pool().target_modules("qkv_proj", "o_proj").obj()) == []
    problems = check_experiment(
        _full("LoRAExperiment", exp), _full("EnginePool", pool().target_modules("q_proj").obj())
    )
    assert [p.field for p in problems] == ["spec.lora.targetModules"]
    assert "q_proj+v_proj or qkv_proj" in problems[0].message


def test_memory_estimate_over_engine_budget() -> None:
    p = pool().model_shape(numLayers=2, hiddenSize=64, kvDim=32).memory(57344)
    assert _fields(experiment("a").rank(8).obj(), p.obj()) == []  # exactly the budget
    assert _fields(experiment("b").rank(16).obj(), p.obj()) == ["spec.lora.rank"]


def test_memory_not_checked_without_model_shape() -> None:
    assert _fields(experiment("a").rank(64).obj(), pool().memory(1).obj()) == []


def test_memory_estimate_uses_pool_shape() -> None:
    p = _full("EnginePool", pool().model_shape(numLayers=2, hiddenSize=64, kvDim=32).obj())
    spec = _full("LoRAExperiment", experiment("a").obj())["spec"]
    assert (
        experiment_memory_bytes(ExperimentSpec.from_obj(spec), EnginePoolSpec.from_obj(p["spec"]))
        == 57344
    )


def test_several_problems_reported_together() -> None:
    exp = experiment("a", namespace="team-z").rank(128).alpha(128).modules("lm_head").obj()
    p = pool().max_rank(32).allowed_namespaces("team-a").obj()
    assert _fields(exp, p) == ["metadata.namespace", "spec.lora.rank", "spec.lora.targetModules"]


def test_client_experiment_is_admitted_like_any_but_its_modules_go_by_kind() -> None:
    """spec.client (what the gateway creates): no task, no targetModules; the pool's rank
    limit and namespaces still apply."""
    exp = experiment("a").client(trainUnembed=False).obj()
    assert _fields(exp, pool().obj()) == []
    assert _fields(exp, pool().target_modules("q_proj").obj()) == []  # no family default needed
    assert _fields(experiment("a").client().rank(64).obj(), pool().max_rank(32).obj()) == [
        "spec.lora.rank"
    ]
    assert ExperimentSpec.from_obj(exp["spec"]).client
    assert not ExperimentSpec.from_obj(experiment("a").obj()["spec"]).client


LLAMA_WRAPPED = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
)


def test_a_client_experiments_kinds_must_train_only_allowed_modules() -> None:
    """What a kind trains is what the pool's engines wrap of that kind (their
    targetModules); every one must be in allowedTargetModules, or the kind is refused,
    named by its field. Unknown until an engine has said what it wraps: not checked."""
    attn_only = pool().target_modules("q_proj", "k_proj", "v_proj", "o_proj").obj()
    exp = _full("LoRAExperiment", experiment("a").client().obj())

    def problems(obj: dict[str, Any], wrapped: frozenset[str] | None) -> list[Problem]:
        view = Pool.from_obj(_full("EnginePool", attn_only))
        return admission.check_experiment(Experiment.from_obj(obj), view, None, None, wrapped)

    found = problems(exp, LLAMA_WRAPPED)
    assert [p.field for p in found] == ["spec.client.trainMlp"]
    assert (
        "down_proj, gate_proj, up_proj" in found[0].message and "trainMlp false" in found[0].message
    )
    no_mlp = _full("LoRAExperiment", experiment("a").client(trainMlp=False).obj())
    assert problems(no_mlp, LLAMA_WRAPPED) == []
    assert problems(exp, None) == []  # no engine has reported yet
    # lm_head is not wrapped here (the engine grants trainUnembed off): nothing to allow.
    found = problems(no_mlp, LLAMA_WRAPPED | {"lm_head"})
    assert [p.field for p in found] == ["spec.client.trainUnembed"]


@pytest.mark.parametrize(
    ("name", "model_id", "admitted"),
    [
        ("tinker-s0123456789abcdef0123-2", "s0123456789abcdef0123:train:2", True),  # gateway's
        ("my-run", "my-run:train:0", True),  # written by hand after its own name
        ("squat", "s0123456789abcdef0123:train:2", False),  # another's id
        ("tinker-s0123456789abcdef0123-2", "s0123456789abcdef0123:train:3", False),
        ("my-run", "my-run2:train:0", False),
    ],
)
def test_a_client_experiment_holds_only_a_model_id_its_name_spells(
    name: str, model_id: str, admitted: bool
) -> None:
    exp = _full("LoRAExperiment", experiment(name).client(model_id, trainUnembed=False).obj())
    problems = check_experiment(exp, _full("EnginePool", pool().obj()))
    fields = [p.field for p in problems]
    assert ("spec.client.modelId" not in fields) == admitted
    if not admitted:
        (why,) = [p.message for p in problems if p.field == "spec.client.modelId"]
        assert model_id in why and f"'{name}:train:<n>'" in why
