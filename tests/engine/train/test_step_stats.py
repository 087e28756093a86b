"""The step statistics the experiment trackers record beyond the mean reward: the
rollout's (train/step_stats.py) and the loss's KL and clip fraction combined over
micro-batches and ranks (train/strategy.with_totals), token-weighted."""

from __future__ import annotations

import math

import pytest
from loraplex_engine.rollout.base import Completion
from loraplex_engine.train.step_stats import rollout_stats
from loraplex_engine.train.strategy import StepTotals, TrainOutcome, with_totals


def test_reward_spread_length_and_sampled_entropy() -> None:
    completions = [Completion([1, 2, 3], [-0.5, -1.0, -1.5]), Completion([4], [-2.0])]
    got = rollout_stats([1.0, 0.0, 1.0, 0.0], completions)
    assert got == pytest.approx({"reward_std": 0.5, "response_tokens": 2.0, "entropy": 1.25})


def test_one_reward_has_no_spread_and_no_tokens_no_entropy() -> None:
    got = rollout_stats([0.75], [Completion([], [])])
    assert got == {"reward_std": 0.0, "response_tokens": 0.0}


def test_an_impossible_sampled_token_leaves_entropy_out() -> None:
    got = rollout_stats([1.0, 1.0], [Completion([1], [-math.inf]), Completion([2], [-1.0])])
    assert "entropy" not in got and got["response_tokens"] == 1.0


def test_kl_and_clip_are_token_weighted_over_ranks() -> None:
    # rank 0: 1 token at kl 0.4, clipped; rank 1: 3 tokens at kl 0.0, one of them clipped
    ranks = [
        StepTotals(kl={"a": (0.4, 1)}, clip={"a": (1.0, 1)}),
        StepTotals(kl={"a": (0.0, 3)}, clip={"a": (1.0, 3)}),
    ]
    got = with_totals({"a": TrainOutcome(), "b": TrainOutcome()}, ranks)
    assert got["a"].kl == pytest.approx(0.1) and got["a"].clip_fraction == pytest.approx(0.5)
    assert got["b"].kl is None and got["b"].clip_fraction is None  # no token trained
    nan = TrainOutcome(kl=float("nan"), clip_fraction=0.25)
    assert nan.finite() == TrainOutcome(clip_fraction=0.25)
