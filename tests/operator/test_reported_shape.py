"""A pool that declares no `modelShape` (pure): the engines report their model's shape on
/v1/capacity, and the round's adapter memory estimate uses it; until an engine reports,
memory checks wait (nothing binds before an engine answers anyway)."""

from __future__ import annotations

from loraplex_operator import admission
from loraplex_operator.api.pool import EnginePoolSpec
from loraplex_operator.observation import EngineView, reported_shape, with_reported_shape
from loraplex_operator.placement import ModelShape
from loraplex_operator.planning import plan_round
from loraplex_operator.resources import ExperimentSpec

from tests.support.builders import experiment, pool
from tests.support.reconcile_inputs import CFG, engine, snap

# What an engine serving Qwen3-4B reports (docs/engine-api.md, Capacity).
QWEN3_4B = {"numLayers": 36, "hiddenSize": 2560, "intermediateSize": 9728, "kvDim": 1024}
QWEN3_4B_SHAPE = ModelShape(num_layers=36, hidden_size=2560, intermediate_size=9728, kv_dim=1024)


def _reporting(name: str) -> EngineView:
    e = engine(name)
    e.capacity = {**(e.capacity or {}), "modelShape": QWEN3_4B}
    return e


def _needs(rank: int) -> int:
    spec = ExperimentSpec.from_obj(experiment("x").rank(rank).obj()["spec"])
    bare = EnginePoolSpec.from_obj(pool().obj()["spec"])
    shaped = bare.model_copy(update={"model_shape": QWEN3_4B_SHAPE})
    return admission.experiment_memory_bytes(spec, shaped)


def test_the_first_answering_engine_names_the_shape() -> None:
    silent = engine("e0", ready=False)
    silent.capacity = {"modelShape": {"numLayers": 1, "hiddenSize": 8}}  # not reachable
    assert reported_shape([silent]) is None
    assert reported_shape([silent, _reporting("e1")]) == QWEN3_4B_SHAPE


def test_a_declared_shape_wins_over_the_reported_one() -> None:
    declared = pool().model_shape(numLayers=2, hiddenSize=64).obj()
    s = with_reported_shape(snap([], [_reporting("e1")], declared))
    assert s.pool.spec.model_shape == ModelShape(num_layers=2, hidden_size=64)


def test_memory_budget_applies_once_an_engine_reports() -> None:
    assert _needs(4) < _needs(64) // 2
    p = pool().slots(4).replicas(0, 2).memory(_needs(64) // 2).obj()  # no modelShape
    big = experiment("big").rank(64).obj()
    small = experiment("small").rank(4).obj()
    before = plan_round(snap([big, small], [], p), CFG)  # no engine has answered yet
    assert before.work["team-a/big"].problems == [] and before.create_pods == 1
    after = plan_round(snap([big, small], [_reporting("e1")], p), CFG)
    (problem,) = after.work["team-a/big"].problems
    assert problem.startswith("spec.lora.rank: adapter needs about")
    assert [put.key for put in after.puts] == ["team-a/small"]
