"""spec.eval's numbers and schedule (spec/eval_scores.py), pure: pass@k against its
definition, the summary of an eval's rewards, which steps are evaluated."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from loraplex_engine.spec.eval_scores import eval_due, eval_seed, pass_at_k, summarize


def _pass_at_k_by_definition(n: int, c: int, k: int) -> Fraction:
    """The share of the k-subsets of n completions (c of them passing) with a pass."""
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(outcomes[i] for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_is_the_share_of_k_subsets_with_a_pass(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            want = _pass_at_k_by_definition(n, c, k)
            # A product of n <= 16 ratios in floats: within a few ulps of the exact share.
            assert pass_at_k(n, c, k) == pytest.approx(float(want), abs=1e-12), (n, c, k)


def test_pass_at_k_edges() -> None:
    assert pass_at_k(16, 0, 16) == 0.0
    assert pass_at_k(16, 1, 16) == 1.0  # n == k: any pass among them
    assert pass_at_k(16, 1, 1) == pytest.approx(1 / 16)  # pass@1 = c / n
    for bad in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(*bad)


def test_summarize_groups_rewards_by_prompt() -> None:
    # Two prompts, 3 samples each: one passes once (c=1), one never (c=0).
    rewards = [1.0, 0.0, 0.5, 0.0, 0.2, 0.9]
    result = summarize(rewards, samples=3, k=2, threshold=1.0, step=4, tokens=99)
    assert result.reward == pytest.approx(sum(rewards) / 6)
    assert result.pass_at_k == pytest.approx((pass_at_k(3, 1, 2) + 0.0) / 2)
    assert (result.step, result.k, result.samples, result.prompts, result.tokens) == (
        4, 2, 3, 2, 99,
    )  # fmt: skip
    # The threshold decides what passes: 0.9 passes at 0.9, both prompts then have one.
    lower = summarize(rewards, samples=3, k=3, threshold=0.9, step=4, tokens=99)
    assert lower.pass_at_k == 1.0
    with pytest.raises(ValueError, match="not 3 per prompt"):
        summarize(rewards[:5], samples=3, k=1, threshold=1.0, step=0, tokens=0)


def test_eval_due_at_zero_every_k_and_the_last_step_once() -> None:
    every, last = 3, 7
    planned: int | None = None
    evaluated = []
    for step in range(last + 1):
        finished = step == last
        # Asked twice per step (the tick plans once; the engine may ask again): once only.
        for _ in range(2):
            if eval_due(step, every, planned, finished):
                evaluated.append(step)
                planned = step
    assert evaluated == [0, 3, 6, 7]
    # maxSteps on the schedule: evaluated once, not twice.
    assert not eval_due(6, 3, 6, True)


def test_eval_seed_is_fixed_per_run_and_step() -> None:
    assert eval_seed(0, 4) == eval_seed(0, 4)
    seeds = {eval_seed(s, step) for s in range(4) for step in range(50)}
    assert len(seeds) == 200  # no two (seed, step) pairs share one
    assert all(0 <= s < 1 << 63 for s in seeds | {eval_seed(2**63 - 1, 10**9)})
