"""Placement from the engines' own memory plan (pure): an engine reports on /v1/capacity
how it sized itself (`plan`: loraplex_engine.spec.api_types.MemoryPlan); every adapter slot is
allocated at max rank on every linear it wraps, so each experiment costs the reported
slot bytes whatever its rank, not the `modelShape` estimate (which counts the
experiment's own rank and targets, and so undercounts). Before any engine has answered,
memory is not guessed."""

from __future__ import annotations

from loraplex_engine.spec.api_types import MemoryPlan
from loraplex_operator.admission import experiment_memory_bytes
from loraplex_operator.observation import EngineMemory, EngineView, slot_bytes
from loraplex_operator.placement import WAIT_STARTING
from loraplex_operator.planning import plan_round
from loraplex_operator.resources import ExperimentSpec, Lora, Pool

from tests.support.builders import experiment, pool
from tests.support.reconcile_inputs import CFG, engine, snap

SLOT = 1_000_000  # bytes one slot takes, as an engine reports it


def _plan(slot: int = SLOT, slots: int = 5) -> dict:
    """What the engine serializes (its own type), so the two sides cannot drift."""
    return MemoryPlan(
        device_total_bytes=80 << 30, device_bytes=80 << 30, headroom=0.15, base_bytes=7 << 30,
        slot_bytes=slot, slots=slots, activation_fixed_bytes=1, activation_bytes_per_token=2,
        activation_bytes_per_adapter=3, kv_bytes_per_token=4, micro_batch_tokens=8192,
        rollout_kv_tokens=100_000, derived=["microBatchTokens"],
    ).to_json()  # fmt: skip


def _planned(name: str, *running: str, slot: int = SLOT) -> EngineView:
    e = engine(name, *running)
    e.capacity = {**(e.capacity or {}), "plan": _plan(slot)}
    return e


def test_the_operator_reads_the_engines_plan_block() -> None:
    memory = EngineMemory.from_capacity({"plan": _plan()})
    assert memory == EngineMemory(SLOT, 5, 7 << 30, 80 << 30, 8192, 100_000)
    assert EngineMemory.from_capacity({"maxAdapters": 4}) is None  # an older engine
    assert EngineMemory.from_capacity(None) is None


def test_slot_bytes_come_from_the_first_engine_that_reports_a_plan() -> None:
    silent = engine("e0", ready=False)
    silent.capacity = {"plan": _plan(slot=7)}  # not reachable: not heard
    assert slot_bytes([]) == 0 and slot_bytes([silent]) == 0  # nobody answered: unknown
    assert slot_bytes([engine("e1")]) is None  # answered without a plan: modelShape applies
    assert slot_bytes([silent, engine("e1"), _planned("e2")]) == SLOT


def test_each_experiment_costs_a_whole_slot_whatever_its_rank() -> None:
    # Budget for two slots; the shape estimate of a rank-4 q/v adapter on this pool's
    # declared 2-layer model (1,024 params x 16 bytes) would let all four fit.
    p = pool().slots(4).replicas(0, 1).memory(2 * SLOT + SLOT // 2)
    p = p.model_shape(numLayers=2, hiddenSize=64).obj()
    exps = [experiment(f"x{i}").rank(4).obj() for i in range(4)]
    plan = plan_round(snap(exps, [_planned("e1")], p), CFG)
    assert sorted(put.key for put in plan.puts) == ["team-a/x0", "team-a/x1"]
    waiting = {w.waiting_reason for k, w in plan.work.items() if k in ("team-a/x2", "team-a/x3")}
    assert waiting == {"NoCapacity"}  # at replicas.max; the engine's memory is full


def test_running_experiments_hold_their_slots_bytes() -> None:
    p = pool().slots(4).replicas(0, 1).memory(2 * SLOT).obj()
    exps = [experiment("a").obj(), experiment("b").obj()]
    plan = plan_round(snap(exps, [_planned("e1", "team-a.a")], p), CFG)
    assert [put.key for put in plan.puts] == ["team-a/b"]  # one slot of two left
    full = plan_round(snap([*exps, experiment("c").obj()],
                           [_planned("e1", "team-a.a", "team-a.b")], p), CFG)  # fmt: skip
    assert [put.key for put in full.puts] == []
    assert full.work["team-a/c"].waiting_reason == "NoCapacity"


def test_memory_waits_for_an_engine_rather_than_guessing() -> None:
    # The declared shape's estimate of a rank-64 adapter is over this budget; before any
    # engine answers nothing is judged on it: the round asks for an engine.
    p = pool().slots(4).replicas(0, 1).memory(1000).model_shape(numLayers=2, hiddenSize=64)
    big = experiment("big").rank(64).obj()
    before = plan_round(snap([big], [], p.obj()), CFG)
    assert before.work["team-a/big"].problems == [] and before.create_pods == 1
    # Once one answers, its slot bytes decide: a slot over the budget fits no engine of
    # this pool, whatever the experiment's rank.
    after = plan_round(snap([big], [_planned("e1")], p.obj()), CFG)
    (problem,) = after.work["team-a/big"].problems
    assert problem.startswith("spec.enginePool: an adapter slot of EnginePool")
    assert f"takes {SLOT} bytes" in problem and after.puts == []


# --- multi-rank engines (spec.gpusPerEngine) -------------------------------------------
# Every rank of an engine holds every adapter slot (data parallel: the same slots, the
# same optimiser step on each). So an engine's capacity is one rank's: it reports one
# rank's plan (slotBytes per rank) and one rank's slot count (maxAdapters), the pool's
# memoryBytes is a per-rank (per-GPU) budget, and the modelShape estimate is one replica.
# More ranks make an engine faster, never roomier: placement must not multiply anything.


def _round(
    gpus: int, engines: list[EngineView], memory: int, shape: bool = False, shard: bool = False
) -> tuple:
    p = pool().gpus(gpus).slots(4).replicas(0, 2).memory(memory).shard_base(shard)
    if shape:
        p = p.model_shape(numLayers=2, hiddenSize=64)
    exps = [experiment(f"x{i}").rank(8).obj() for i in range(7)]
    plan = plan_round(snap(exps, engines, p.obj()), CFG)
    waiting = {k: w.waiting_reason for k, w in plan.work.items() if w.waiting_reason}
    return sorted((put.key, put.engine) for put in plan.puts), plan.create_pods, waiting


def test_a_multi_rank_engine_holds_what_one_rank_holds() -> None:
    # One engine reporting its plan (a budget of two slots per rank) and one starting.
    def engines() -> list[EngineView]:
        return [_planned("e1"), engine("e2", ready=False)]

    one_rank = _round(1, engines(), 2 * SLOT + SLOT // 2)
    assert [key for key, _ in one_rank[0]] == ["team-a/x0", "team-a/x1"]
    for gpus in (2, 8):
        assert _round(gpus, engines(), 2 * SLOT + SLOT // 2) == one_rank


def test_slots_are_one_ranks_not_the_sum_over_ranks() -> None:
    # No memory budget: an engine with four slots takes four experiments, whatever its
    # ranks (each rank holds all four), and the rest wait for the engine starting.
    for gpus in (1, 4):
        puts, create, waiting = _round(gpus, [_planned("e1"), engine("e2", ready=False)], 0)
        assert len(puts) == 4 and create == 0
        assert set(waiting.values()) == {WAIT_STARTING}, waiting


def test_the_model_shape_fallback_is_one_replica_against_a_per_rank_budget() -> None:
    # An engine that reports no plan: each experiment costs the declared shape's estimate
    # of one adapter (2 layers x rank 8 x (64+64) x 2 modules x 16 bytes = 65,536), the
    # same on every rank; a per-rank budget of three of them fits three, at any rank count.
    cost = 2 * 8 * (64 + 64) * 2 * 16
    spec = Pool.from_obj(pool().gpus(8).model_shape(numLayers=2, hiddenSize=64).obj()).spec
    assert experiment_memory_bytes(ExperimentSpec(lora=Lora(rank=8)), spec) == cost
    one_rank = _round(1, [engine("e1")], 3 * cost, shape=True)
    assert len(one_rank[0]) == 3
    assert _round(8, [engine("e1")], 3 * cost, shape=True) == one_rank


# --- a sharded base (spec.shardBase) ---------------------------------------------------
# FSDP2 shards the frozen base over the ranks and leaves the adapter slots whole on each
# (ignored_params: docs/design/parallel.md). What placement counts,
# capacity.memoryBytes against a slot's bytes, is adapter memory only: the base is in
# neither the engine's slotBytes nor the modelShape estimate, so sharding it divides
# nothing there. The base's shard (and FSDP's unsharded reserve) is the engine's own
# business: its plan spends what the rank's shard leaves on micro-batches and KV cache.


def test_a_sharded_base_changes_no_slots_cost() -> None:
    cost = 2 * 8 * (64 + 64) * 2 * 16  # as in the test above: one replica of the adapter
    for gpus in (2, 8):
        sharded = pool().gpus(gpus).shard_base().model_shape(numLayers=2, hiddenSize=64)
        spec = Pool.from_obj(sharded.obj()).spec
        assert spec.shard_base is True
        assert experiment_memory_bytes(ExperimentSpec(lora=Lora(rank=8)), spec) == cost


def test_a_sharded_pool_places_as_a_replicated_one() -> None:
    def engines() -> list[EngineView]:
        return [_planned("e1"), engine("e2", ready=False)]

    budget = 2 * SLOT + SLOT // 2
    for gpus in (2, 8):
        assert _round(gpus, engines(), budget, shard=True) == _round(gpus, engines(), budget)
        shaped = _round(gpus, [engine("e1")], 3 * 65_536, shape=True, shard=True)
        assert len(shaped[0]) == 3  # the modelShape fallback: three replicas' worth fit
