"""Who rolls out in a tick (tick/fair_share.py): one size in lockstep, expensive steps
yield, and a namespace's late reward calls are capped."""

from __future__ import annotations

import threading
import time

from loraplex_engine.experiment import Experiment, new_experiment
from loraplex_engine.plan.experiment import compile_plan
from loraplex_engine.plan.limits import EngineLimits
from loraplex_engine.tenancy.trust import TrustPolicy
from loraplex_engine.tick.fair_share import (
    EXPENSIVE_YIELD,
    RewardScorer,
    due_to_roll_out,
    rollout_interval,
)

from tests.support.engine_builders import spec


def experiment(exp_id: str, cost: int = 0, namespace: str = "default") -> Experiment:
    plan = compile_plan(spec(), EngineLimits(64, frozenset({"q_proj", "v_proj", "lm_head"})))
    exp = new_experiment(exp_id, plan, namespace, exp_id, None, TrustPolicy())
    exp.step_cost = cost
    return exp


def run_ticks(exps: list[Experiment], ticks: int) -> dict[str, int]:
    """Roll out as the tick does (the chosen ones record the tick); count per experiment."""
    counts = dict.fromkeys((e.id for e in exps), 0)
    for tick_no in range(1, ticks + 1):
        for e in due_to_roll_out(exps, tick_no):
            e.rolled_out_at = tick_no
            counts[e.id] += 1
    return counts


def test_experiments_of_about_one_size_step_every_tick() -> None:
    exps = [experiment("a", 100), experiment("b", 140), experiment("c", 0)]  # c: no step yet
    assert run_ticks(exps, 50) == {"a": 50, "b": 50, "c": 50}


def test_an_expensive_step_yields_to_the_cheap_one() -> None:
    cheap, big = experiment("cheap", 100), experiment("big", 1000)
    counts = run_ticks([cheap, big], 300)
    assert counts["cheap"] == 300
    assert counts["big"] == 300 // (EXPENSIVE_YIELD * 10)
    # Alone, the expensive one runs every tick: it yields only to a cheaper tenant.
    assert run_ticks([experiment("alone", 1000)], 20) == {"alone": 20}


def test_no_tick_is_left_empty_while_work_waits() -> None:
    # The cheap one's reward is pending, so only the big one is eligible: it is not
    # made to wait for its interval when nothing else would run.
    big = experiment("big", 1000)
    big.rolled_out_at = 5
    assert [e.id for e in due_to_roll_out([big], 6)] == ["big"]
    assert rollout_interval(1000, 100) == 30 and rollout_interval(149, 100) == 1


def test_a_namespace_at_its_cap_of_calls_in_flight_waits_and_others_do_not() -> None:
    release = threading.Event()
    scorer: RewardScorer[bool] = RewardScorer(0.01, lambda: None, max_per_namespace=2)
    a1, a2, a3 = (experiment(f"a{i}", namespace="team-a") for i in (1, 2, 3))
    b1 = experiment("b1", namespace="team-b")
    closed: list[str] = []
    a1.task.close = lambda: closed.append("a1")  # type: ignore[method-assign]
    try:
        assert scorer.score([(a1, release.wait), (a2, release.wait)]) == []  # both late
        assert scorer.in_flight("team-a") == 2
        assert scorer.waits(a1) and scorer.waits(a3)  # a3: not pending, its namespace full
        assert not scorer.waits(b1)
        # Removed: its reward is closed, and its call counts until it has ended.
        scorer.forget(a1)
        assert closed == ["a1"] and not scorer.is_pending(a1) and scorer.waits(a3)
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while scorer.in_flight("team-a") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scorer.in_flight("team-a") == 0 and not scorer.waits(a3)
    assert scorer.arrived([a2]) == [True]  # a1 was removed: its result is dropped


def test_an_experiment_may_have_several_rewards_pending() -> None:
    """Under the pipelined schedule with maxStaleness > 0; each comes back when done (the
    pipelined tick trains them in the order they started: pipelined_tick.Lane)."""
    first, second = threading.Event(), threading.Event()
    scorer: RewardScorer[str] = RewardScorer(0.01, lambda: None)
    a, b = experiment("a"), experiment("b")

    def call(ev: threading.Event, name: str) -> str:
        ev.wait(5)
        return name

    assert scorer.score([(a, lambda: call(first, "a1"))]) == []
    assert scorer.score([(a, lambda: call(second, "a2")), (b, lambda: "b1")]) == ["b1"]
    assert scorer.pending(a) == 2 and scorer.pending(b) == 0
    assert scorer.waits(a) and not scorer.namespace_full(a)
    second.set()  # the later call ends first
    deadline = time.monotonic() + 5
    while scorer.in_flight("default") > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scorer.arrived([a]) == ["a2"] and scorer.pending(a) == 1
    first.set()
    while scorer.in_flight("default") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scorer.arrived([a]) == ["a1"] and not scorer.is_pending(a)
