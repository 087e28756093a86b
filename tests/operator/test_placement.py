"""Placement decisions, table-driven, plus invariants on random inputs."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from loraplex_operator.placement import (
    SLOTS_FIRST,
    WAIT_NO_CAPACITY,
    WAIT_PREEMPTING,
    WAIT_STARTING,
    WAIT_UNSCHEDULABLE,
    Bind,
    Decision,
    Engine,
    ModelShape,
    PendingExperiment,
    PoolLimits,
    Preempt,
    ScaleUp,
    Wait,
    adapter_memory_bytes,
    lora_params,
    plan,
)

from tests.support.builders import engine, limits, pending, run


def bindings(decisions: list[Decision]) -> dict[str, str]:
    """experiment key -> engine name for the Bind decisions."""
    return {d.experiment: d.engine for d in decisions if isinstance(d, Bind)}


@dataclass
class Case:
    name: str
    pending: list[PendingExperiment]
    engines: list[Engine]
    limits: PoolLimits
    want: list[Decision] = field(default_factory=list)


def _exps(n: int, **kw: int) -> list[PendingExperiment]:
    return [
        pending(f"ns/e{i}")
        .created(i)
        .rank(kw.get("rank", 8))
        .priority(kw.get("priority", 0))
        .build()
        for i in range(n)
    ]


CASES = [
    Case(
        "six onto two engines of four: fill one first",
        pending=_exps(6),
        engines=[engine("a").slots(4).build(), engine("b").slots(4).build()],
        limits=limits(max_replicas=2, current=2),
        want=[
            Bind("ns/e0", "a"),
            Bind("ns/e1", "a"),
            Bind("ns/e2", "a"),
            Bind("ns/e3", "a"),
            Bind("ns/e4", "b"),
            Bind("ns/e5", "b"),
        ],
    ),
    Case(
        "best fit by slots: the fuller engine",
        pending=_exps(1),
        engines=[engine("a").slots(4, used=1).build(), engine("b").slots(4, used=3).build()],
        limits=limits(2, 2),
        want=[Bind("ns/e0", "b")],
    ),
    Case(
        "rank filter: only an engine with enough max rank",
        pending=[pending("ns/big").rank(64).build()],
        engines=[engine("a").max_rank(32).build(), engine("b").max_rank(128).build()],
        limits=limits(2, 2),
        want=[Bind("ns/big", "b")],
    ),
    Case(
        "rank headroom: keep the high-rank engine free",
        pending=[pending("ns/small").rank(16).build()],
        engines=[engine("a").max_rank(128).build(), engine("b").max_rank(32).build()],
        limits=limits(2, 2),
        want=[Bind("ns/small", "b")],
    ),
    Case(
        "memory: skip an engine whose budget would overflow",
        pending=[pending("ns/m").memory(50).build()],
        engines=[
            engine("a").slots(4, used=3).memory(100, used=60).build(),
            engine("b").memory(100).build(),
        ],
        limits=limits(2, 2),
        want=[Bind("ns/m", "b")],
    ),
    Case(
        "memory breaks a slot and rank tie: the tighter budget",
        pending=[pending("ns/m").memory(10).build()],
        engines=[
            engine("a").memory(100, used=10).build(),
            engine("b").memory(100, used=50).build(),
        ],
        limits=limits(2, 2),
        want=[Bind("ns/m", "b")],
    ),
    Case(
        "not-ready engines are never bound; their room is reserved (no scale-up)",
        pending=_exps(2),
        engines=[engine("a").not_ready().slots(1).build(), engine("b").slots(1).build()],
        limits=limits(3, 2),
        want=[Bind("ns/e0", "b"), Wait("ns/e1", WAIT_STARTING, "a")],
    ),
    Case(
        "scale up for what does not fit, once per engine needed",
        pending=_exps(6),
        engines=[],
        limits=limits(max_replicas=3, current=0, slots=4),
        want=[ScaleUp(2)] + [Wait(f"ns/e{i}", WAIT_STARTING) for i in range(6)],
    ),
    Case(
        "scale up stops at max replicas",
        pending=_exps(6),
        engines=[],
        limits=limits(max_replicas=1, current=0, slots=4),
        want=[ScaleUp(1)]
        + [Wait(f"ns/e{i}", WAIT_STARTING) for i in range(4)]
        + [Wait("ns/e4", WAIT_NO_CAPACITY), Wait("ns/e5", WAIT_NO_CAPACITY)],
    ),
    Case(
        "priority first, then age",
        pending=[
            pending("ns/old").created(1).build(),
            pending("ns/vip").created(9).priority(5).build(),
            pending("ns/young").created(5).build(),
        ],
        engines=[engine("a").slots(2).build()],
        limits=limits(1, 1),
        want=[Bind("ns/vip", "a"), Bind("ns/old", "a"), Wait("ns/young", WAIT_NO_CAPACITY)],
    ),
    Case(
        "preempt the lowest priority, newest first, when the pool cannot grow",
        pending=[pending("ns/vip").priority(5).build()],
        engines=[
            engine("a")
            .slots(3)
            .running(
                run("ns/r1", priority=1, started=1),
                run("ns/r0", priority=0, started=1),
                run("ns/r0new", priority=0, started=2),
            )
            .build()
        ],
        limits=limits(1, 1),
        want=[Preempt("ns/r0new", "a", "ns/vip"), Wait("ns/vip", WAIT_PREEMPTING)],
    ),
    Case(
        "no preemption for equal priority",
        pending=[pending("ns/peer").priority(1).build()],
        engines=[engine("a").slots(1).running(run("ns/r", priority=1)).build()],
        limits=limits(1, 1),
        want=[Wait("ns/peer", WAIT_NO_CAPACITY)],
    ),
    Case(
        "no preemption while the pool can scale up",
        pending=[pending("ns/vip").priority(5).build()],
        engines=[engine("a").slots(1).running(run("ns/r", priority=0)).build()],
        limits=limits(2, 1),
        want=[ScaleUp(1), Wait("ns/vip", WAIT_STARTING)],
    ),
    Case(
        "a preempted slot is reserved: the next preemptor takes another victim",
        pending=[pending("ns/p5").priority(5).build(), pending("ns/p3").priority(3).build()],
        engines=[
            engine("a").slots(2).running(run("ns/x", started=1), run("ns/y", started=2)).build()
        ],
        limits=limits(1, 1),
        want=[
            Preempt("ns/y", "a", "ns/p5"),
            Wait("ns/p5", WAIT_PREEMPTING),
            Preempt("ns/x", "a", "ns/p3"),
            Wait("ns/p3", WAIT_PREEMPTING),
        ],
    ),
    Case(
        "preemption for memory takes as many victims as needed",
        pending=[pending("ns/vip").priority(5).memory(80).build()],
        engines=[
            engine("a")
            .slots(4)
            .memory(100)
            .running(run("ns/r1", memory=40, started=1), run("ns/r2", memory=40, started=2))
            .build()
        ],
        limits=limits(1, 1),
        want=[
            Preempt("ns/r2", "a", "ns/vip"),
            Preempt("ns/r1", "a", "ns/vip"),
            Wait("ns/vip", WAIT_PREEMPTING),
        ],
    ),
    Case(
        "prefer the engine whose victims have the lowest priority",
        pending=[pending("ns/vip").priority(9).build()],
        engines=[
            engine("a").slots(1).running(run("ns/ra", priority=3)).build(),
            engine("b").slots(1).running(run("ns/rb", priority=1)).build(),
        ],
        limits=limits(2, 2),
        want=[Preempt("ns/rb", "b", "ns/vip"), Wait("ns/vip", WAIT_PREEMPTING)],
    ),
    Case(
        "priority classes: a higher class preempts a lower one of its own namespace",
        pending=[pending("team-a/high").priority(10).build()],
        engines=[engine("a").slots(1).running(run("team-a/low")).build()],
        limits=limits(1, 1),
        want=[Preempt("team-a/low", "a", "team-a/high"), Wait("team-a/high", WAIT_PREEMPTING)],
    ),
    Case(
        "priority classes: not another namespace's, without preemptOtherNamespaces",
        pending=[pending("team-a/high").priority(10).build()],
        engines=[engine("a").slots(1).running(run("team-b/low")).build()],
        limits=limits(1, 1),
        want=[Wait("team-a/high", WAIT_NO_CAPACITY)],
    ),
    Case(
        "priority classes: another namespace's too, with preemptOtherNamespaces",
        pending=[pending("team-a/high").priority(10).cross().build()],
        engines=[engine("a").slots(1).running(run("team-b/low")).build()],
        limits=limits(1, 1),
        want=[Preempt("team-b/low", "a", "team-a/high"), Wait("team-a/high", WAIT_PREEMPTING)],
    ),
    Case(
        "priority classes: preemptOtherNamespaces still needs a strictly lower value",
        pending=[pending("team-a/high").priority(10).cross().build()],
        engines=[engine("a").slots(1).running(run("team-b/peer", priority=10)).build()],
        limits=limits(1, 1),
        want=[Wait("team-a/high", WAIT_NO_CAPACITY)],
    ),
    Case(
        "priority classes: another namespace's lowest is skipped for its own lower one",
        pending=[pending("team-a/high").priority(10).build()],
        engines=[
            engine("a")
            .slots(2)
            .running(run("team-b/lowest", priority=-5), run("team-a/low", priority=0))
            .build()
        ],
        limits=limits(1, 1),
        want=[Preempt("team-a/low", "a", "team-a/high"), Wait("team-a/high", WAIT_PREEMPTING)],
    ),
    Case(
        "priority classes: the engine with an own-namespace victim, not the cheaper other",
        pending=[pending("team-a/high").priority(10).build()],
        engines=[
            engine("a").slots(1).running(run("team-b/r", priority=0)).build(),
            engine("b").slots(1).running(run("team-a/r", priority=5)).build(),
        ],
        limits=limits(2, 2),
        want=[Preempt("team-a/r", "b", "team-a/high"), Wait("team-a/high", WAIT_PREEMPTING)],
    ),
    Case(
        "no preemption on an engine whose max rank is too small",
        pending=[pending("ns/vip").priority(9).rank(128).build()],
        engines=[engine("a").slots(1).max_rank(64).running(run("ns/r")).build()],
        limits=limits(1, 1, max_rank=64),
        want=[Wait("ns/vip", WAIT_UNSCHEDULABLE)],
    ),
    Case(
        "unschedulable on this pool: no scale-up for a rank no engine can hold",
        pending=[pending("ns/huge").rank(256).build()],
        engines=[],
        limits=limits(4, 0, max_rank=64),
        want=[Wait("ns/huge", WAIT_UNSCHEDULABLE)],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_plan(case: Case) -> None:
    assert plan(case.pending, case.engines, case.limits) == case.want


def test_rank_first_keeps_high_rank_engines_for_high_ranks() -> None:
    engines = [
        engine("big-rank").slots(4, used=3).max_rank(128).build(),
        engine("small-rank").slots(8).max_rank(16).build(),
    ]
    exps = [pending("ns/r16").rank(16).build()]
    assert plan(exps, engines, limits(2, 2)) == [Bind("ns/r16", "small-rank")]
    assert plan(exps, engines, limits(2, 2), order=SLOTS_FIRST) == [Bind("ns/r16", "big-rank")]


def test_plan_is_deterministic_under_input_order() -> None:
    rng = random.Random(3)
    exps, engines, lim = _random_round(rng)
    first = plan(exps, engines, lim)
    for _ in range(5):
        rng.shuffle(exps)
        rng.shuffle(engines)
        assert plan(exps, engines, lim) == first


TEAMS = ("ns", "nt")


def _random_round(rng: random.Random) -> tuple[list[PendingExperiment], list[Engine], PoolLimits]:
    exps = [
        pending(f"{rng.choice(TEAMS)}/x{i}").rank(rng.choice([4, 8, 16, 64, 128]))
        .priority(rng.randint(0, 3)).cross(rng.random() < 0.3)
        .created(rng.randint(0, 50)).memory(rng.choice([0, 10, 30])).build()
        for i in range(rng.randint(0, 40))
    ]  # fmt: skip
    engines = []
    for j in range(rng.randint(0, 6)):
        total = rng.choice([1, 2, 4, 8])
        runs = [
            run(f"{rng.choice(TEAMS)}/r{j}-{k}", priority=rng.randint(0, 3), memory=10, started=k)
            for k in range(rng.randint(0, total))
        ]
        w = (
            engine(f"e{j}")
            .slots(total)
            .max_rank(rng.choice([16, 64, 128]))
            .memory(rng.choice([0, 100]))
        )
        if rng.random() < 0.2:
            w = w.not_ready()
        engines.append(w.running(*runs).build())
    lim = limits(
        max_replicas=len(engines) + rng.randint(0, 2),
        current=len(engines),
        slots=4,
        max_rank=64,
        memory=100,
    )
    return exps, engines, lim


@pytest.mark.parametrize("seed", range(40))
def test_invariants_on_random_rounds(seed: int) -> None:
    rng = random.Random(seed)
    exps, engines, lim = _random_round(rng)
    decisions = plan(exps, engines, lim)
    by_name = {e.name: e for e in engines}
    prio = {p.key: p for p in exps}
    # every pending experiment gets exactly one Bind or Wait
    outcome = Counter(d.experiment for d in decisions if isinstance(d, Bind | Wait))
    assert outcome == Counter(p.key for p in exps)
    # never over-commit: preempted victims free room, binds consume it
    freed = Counter(d.engine for d in decisions if isinstance(d, Preempt))
    freed_mem = Counter()
    for d in decisions:
        if isinstance(d, Preempt):
            freed_mem[d.engine] += next(
                r.memory_bytes for r in by_name[d.engine].running if r.key == d.victim
            )
    for name, n in Counter(bindings(decisions).values()).items():
        eng = by_name[name]
        assert eng.ready
        assert eng.slots_used + n <= eng.slots_total + freed[name]
        mem = sum(prio[k].memory_bytes for k, e in bindings(decisions).items() if e == name)
        assert (
            eng.memory_budget == 0 or eng.memory_used + mem <= eng.memory_budget + freed_mem[name]
        )
    for k, name in bindings(decisions).items():
        assert prio[k].rank <= by_name[name].max_rank
    # preemption only of strictly lower priorities, of another namespace only by a class
    # that allows it, and never alongside a scale-up
    for d in decisions:
        if isinstance(d, Preempt):
            victim = next(r for r in by_name[d.engine].running if r.key == d.victim)
            preemptor = prio[d.for_experiment]
            assert victim.priority < preemptor.priority
            assert victim.namespace == preemptor.namespace or preemptor.preempts_other_namespaces
    scale = sum(d.count for d in decisions if isinstance(d, ScaleUp))
    fresh = (
        engine("fresh")
        .slots(lim.slots_per_engine)
        .max_rank(lim.max_rank)
        .memory(lim.memory_budget)
        .build()
    )
    for d in decisions:
        if isinstance(d, Preempt):  # only when growing the pool could not have helped
            exp = prio[d.for_experiment]
            fits_fresh = exp.rank <= fresh.max_rank and (
                not fresh.memory_budget or exp.memory_bytes <= fresh.memory_budget
            )
            assert lim.current_replicas + scale >= lim.max_replicas or not fits_fresh
    assert lim.current_replicas + scale <= max(lim.max_replicas, lim.current_replicas)


# --- memory estimate -------------------------------------------------------------------


def test_lora_params_counts_a_and_b_per_layer() -> None:
    shape = ModelShape(num_layers=2, hidden_size=64, intermediate_size=128, kv_dim=32)
    # q: 8*(64+64) = 1024, v: 8*(64+32) = 768 → 1792 per layer, 2 layers
    assert lora_params(8, ["q_proj", "v_proj"], shape) == 3584
    assert lora_params(8, ["down_proj"], shape) == 2 * 8 * (128 + 64)


def test_adapter_memory_counts_weights_grads_and_adam_moments() -> None:
    shape = ModelShape(num_layers=2, hidden_size=64, kv_dim=32)
    assert adapter_memory_bytes(8, ["q_proj", "v_proj"], shape) == 3584 * (4 + 4 + 8)
    assert adapter_memory_bytes(8, ["q_proj", "v_proj"], shape, weight_bytes=2) == 3584 * (
        2 + 2 + 8
    )
    assert adapter_memory_bytes(16, ["q_proj"], shape) == 2 * adapter_memory_bytes(
        8, ["q_proj"], shape
    )
    assert adapter_memory_bytes(8, ["q_proj", "q_proj"], shape) == adapter_memory_bytes(
        8, ["q_proj"], shape
    )


def test_adapter_memory_without_a_shape_is_not_enforced() -> None:
    assert adapter_memory_bytes(64, ["q_proj"], None) == 0


def test_qwen3_4b_rank16_attention_adapter_is_tens_of_megabytes() -> None:
    shape = ModelShape(num_layers=36, hidden_size=2560, intermediate_size=9728, kv_dim=1024)
    mib = adapter_memory_bytes(16, ["q_proj", "k_proj", "v_proj", "o_proj"], shape) / 2**20
    assert 50 < mib < 200
