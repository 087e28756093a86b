"""Placement by registered adapters (docs/design/paging.md): an engine that reports
`maxRegistered` takes experiments up to it, one that does not is packed by its slots, and
the pool's spec flows to the engine's flags. The real-engine scenarios are in
test_paging_placement_e2e.py."""

from __future__ import annotations

from loraplex_operator.manifests import engine_args
from loraplex_operator.observation import EngineView, pool_observation
from loraplex_operator.planning import plan_round
from loraplex_operator.resources import Pool
from loraplex_operator.status import PoolPaging, pool_status

from tests.support.builders import experiment, pool
from tests.support.reconcile_inputs import CFG, NOW, engine, snap

SLOT = 1_000_000


def _paging(name: str, *running: str, registers: int, paged: int = 0, **more: int) -> EngineView:
    """An engine with 2 slots that registers `registers` adapters, `paged` of those
    running paged out (the engine counts only resident ones in usedSlots)."""
    e = engine(name, *running, slots=2)
    said = {"maxRegistered": registers, "pagedAdapters": paged, **more}
    e.capacity = {**(e.capacity or {}), "usedSlots": len(running) - paged, **said}
    return e


def _bound(exps: list[str], engines: list[EngineView], p: dict) -> list[tuple[str, str]]:
    plan = plan_round(snap([experiment(x).obj() for x in exps], engines, p), CFG)
    return sorted((put.key, put.engine) for put in plan.puts)


def test_an_engine_that_registers_more_than_its_slots_takes_more_experiments() -> None:
    p = pool().slots(2).replicas(0, 1).obj()
    bound = _bound([f"x{i}" for i in range(5)], [_paging("e1", registers=4)], p)
    assert [engine for _, engine in bound] == ["e1"] * 4  # its registered count, not 2


def test_paged_out_adapters_count_against_its_registered_room() -> None:
    # Three running, one paged out: usedSlots says 2 (full slots); registered is 3 of 4.
    e1 = _paging("e1", "team-a.a", "team-a.b", "team-a.c", registers=4, paged=1)
    p = pool().slots(2).replicas(0, 1).obj()
    assert _bound(["x0", "x1"], [e1], p) == [("team-a/x0", "e1")]


def test_an_engine_that_does_not_report_max_registered_is_packed_by_slots() -> None:
    p = pool().slots(2).replicas(0, 1).obj()
    old = engine("e1", slots=2)  # an engine before paging: no maxRegistered
    assert "maxRegistered" not in (old.capacity or {})
    assert len(_bound([f"x{i}" for i in range(5)], [old], p)) == 2


def test_a_paging_engine_costs_device_memory_for_its_slots_only() -> None:
    # Budget for two slots: a paging engine holds two resident whatever it registers; an
    # engine that does not page stops at the budget.
    p = pool().slots(2).replicas(0, 1).memory(2 * SLOT).model_shape(numLayers=2, hiddenSize=64)
    plan_block = {"slotBytes": SLOT, "slots": 3, "baseBytes": 1, "microBatchTokens": 1}
    paging = _paging("e1", registers=6)
    paging.capacity = {**(paging.capacity or {}), "plan": plan_block}
    assert len(_bound([f"x{i}" for i in range(5)], [paging], p.obj())) == 5
    tight = p.memory(SLOT).obj()
    assert len(_bound([f"x{i}" for i in range(5)], [paging], tight)) == 1


def test_new_engines_are_planned_with_the_pools_max_registered() -> None:
    p = pool().slots(2).replicas(0, 3).set("spec.capacity.maxRegistered", 8).obj()
    plan = plan_round(snap([experiment(f"x{i}").obj() for i in range(8)], [], p), CFG)
    assert plan.create_pods == 1  # one engine registers all eight
    by_slots = pool().slots(2).replicas(0, 3).obj()  # absent: a new engine holds its slots
    six = [experiment(f"x{i}").obj() for i in range(6)]
    assert plan_round(snap(six, [], by_slots), CFG).create_pods == 3


def test_the_pool_spec_sets_the_engines_paging_flags() -> None:
    p = pool().slots(4).set("spec.capacity.maxRegistered", 256)
    p = p.set("spec.capacity.hostAdapterMemoryBytes", 8 << 30).obj()
    args = engine_args(Pool.from_obj(p).spec)
    assert args[args.index("--max-registered") + 1] == "256"
    assert args[args.index("--host-adapter-memory") + 1] == str(8 << 30)
    plain = engine_args(Pool.from_obj(pool().slots(4).obj()).spec)
    # Absent: the pool does not page (its slots), whatever the engine's own default.
    assert plain[plain.index("--max-registered") + 1] == "4"
    assert "--host-adapter-memory" not in plain


def test_pool_status_counts_registered_and_paged_adapters() -> None:
    paging = _paging(
        "e1", "team-a.a", "team-a.b", "team-a.c", registers=8, paged=1,
        spilledAdapters=1, pagedHostBytes=4096,
    )  # fmt: skip
    old = engine("e2", "team-a.d", slots=2)
    obs = pool_observation(snap([], [paging, old], pool().slots(2).obj()))
    assert obs.paging == PoolPaging(
        registered_used=4, registered_free=6, paged_adapters=1, spilled_adapters=1,
        paged_host_bytes=4096,
    )  # fmt: skip
    status = pool_status(obs, 1, None, _now()).model_dump(by_alias=True, exclude_none=True)
    assert status["registeredUsed"] == 4 and status["pagedHostBytes"] == 4096
    assert status["slotsUsed"] == 3  # resident only: two on e1, one on e2


def _now():
    from datetime import UTC, datetime

    return datetime.fromtimestamp(NOW, UTC)
