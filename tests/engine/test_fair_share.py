"""Who rolls out in a tick (tenancy/fair_share.py): one size in lockstep, expensive steps yield."""

from __future__ import annotations

from loraplex_engine.experiment import Experiment, new_experiment
from loraplex_engine.tenancy.fair_share import EXPENSIVE_YIELD, due_to_roll_out, rollout_interval
from loraplex_engine.tenancy.trust import TrustPolicy

from tests.engine.engine_builders import spec


def experiment(exp_id: str, cost: int) -> Experiment:
    exp = new_experiment(exp_id, spec(), "default", exp_id, None, TrustPolicy())
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
