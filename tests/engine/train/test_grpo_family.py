"""The GRPO family's maths on hand-computed cases (train/algorithms/advantages.py and
grpo.py): RLOO and the reward scalings, DAPO's overlong shaping, dynamic-sampling filter,
clip-higher and token-mean aggregation, Dr. GRPO's sum over maxNewTokens, GSPO's
sequence ratio, the k1/k3 KL estimators; and the spec reaching them whole."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch
from loraplex_engine.spec.algorithm import (
    AdvantageEstimatorName,
    KLEstimator,
    LossAggregation,
    ScaleRewards,
)
from loraplex_engine.spec.experiment import AlgorithmSpec, parse_spec
from loraplex_engine.train.algorithms import (
    ClippedRatioLoss,
    GroupRelativeAdvantages,
    LossInputs,
    RewardShaping,
    build_algorithm,
    group_advantages,
    grpo_loss,
)
from loraplex_engine.train.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    SCALE_REWARDS,
    overlong_penalty,
    scaled_advantages,
    zero_variance_groups,
)
from loraplex_engine.train.algorithms.grpo import KL_ESTIMATORS, LOSS_AGGREGATIONS, kl_per_token
from loraplex_engine.train.experiment_rows import Sample, experiment_rows, step_loss

# fp32 arithmetic on a handful of values: a few ulps of 1.
TOL = 1e-6


def test_spec_literals_match_the_train_cores() -> None:
    # spec/algorithm.py stays torch-free, so it spells the names again.
    assert get_args(AdvantageEstimatorName) == ADVANTAGE_ESTIMATORS
    assert get_args(ScaleRewards) == SCALE_REWARDS
    assert get_args(LossAggregation) == LOSS_AGGREGATIONS
    assert get_args(KLEstimator) == KL_ESTIMATORS


# ---- advantages ----------------------------------------------------------------------


def test_rloo_subtracts_the_mean_of_the_others() -> None:
    adv = scaled_advantages(torch.tensor([3.0, 1.0, 2.0]), 3, "rloo", "none")
    # 3 - (1+2)/2, 1 - (3+2)/2, 2 - (3+1)/2
    assert torch.allclose(adv, torch.tensor([1.5, -1.5, 0.0]), atol=TOL)
    # = G/(G-1) × GRPO's centring
    grpo = scaled_advantages(torch.tensor([3.0, 1.0, 2.0]), 3, "grpo", "none")
    assert torch.allclose(adv, grpo * 3 / 2, atol=TOL)


def test_group_scaling_is_grpos_and_none_is_dr_grpos() -> None:
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0, 5.0, 1.0])
    assert torch.equal(scaled_advantages(rewards, 2, "grpo", "group"), group_advantages(rewards, 2))
    none = scaled_advantages(rewards, 2, "grpo", "none")
    assert torch.allclose(none, torch.tensor([0.5, -0.5, 0.0, 0.0, 2.0, -2.0]), atol=TOL)


def test_batch_scaling_divides_by_the_whole_steps_std() -> None:
    adv = scaled_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, "grpo", "batch")
    std = math.sqrt(0.1875)  # population std of {1, 0, 1, 1}: mean 0.75
    want = torch.tensor([0.5, -0.5, 0.0, 0.0]) / (std + 1e-6)
    assert torch.allclose(adv, want, atol=TOL)


def test_estimator_refuses_unknown_names_and_ragged_groups() -> None:
    with pytest.raises(ValueError, match="estimator"):
        GroupRelativeAdvantages("gae")
    with pytest.raises(ValueError, match="scale"):
        GroupRelativeAdvantages("grpo", "std")
    with pytest.raises(ValueError, match="multiple of group_size=3"):
        scaled_advantages(torch.zeros(4), 3)


def test_overlong_penalty_is_linear_over_the_buffer() -> None:
    # max 10, buffer 4: free up to 6 tokens, then -(L - 6)/4 × penalty, all of it at 10.
    got = overlong_penalty(torch.tensor([3, 6, 7, 8, 10]), 10, 4, 0.5)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]), atol=TOL)
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(torch.tensor([1]), 10, 11, 1.0)


def test_zero_variance_groups_are_exactly_equal_ones() -> None:
    flat = zero_variance_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.3, 0.3]), 2)
    assert flat.tolist() == [True, False, True]


def _algorithm(**settings: object) -> object:
    spec = AlgorithmSpec.model_validate({"groupSize": 2, **settings})
    return build_algorithm(spec, 10)


def test_dynamic_sampling_keeps_the_groups_with_signal() -> None:
    alg = _algorithm(dynamicSampling=True)
    step = alg.step_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), [3, 3, 3, 3], 2)
    assert step.keep.tolist() == [False, False, True, True] and step.dropped_groups == 1
    off = _algorithm().step_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), [3] * 4, 2)
    assert off.keep.all() and off.dropped_groups == 0


def test_overlong_shaping_comes_before_the_filter() -> None:
    # Both completions right, but one ends in the buffer: the group now has signal.
    alg = _algorithm(dynamicSampling=True, overlong={"bufferTokens": 4})
    step = alg.step_advantages(torch.tensor([1.0, 1.0]), [6, 10], 2)
    assert torch.allclose(step.rewards, torch.tensor([1.0, 0.0]), atol=TOL)
    assert step.keep.all() and step.advantages[0] > 0 > step.advantages[1]


def test_experiment_rows_drop_filtered_groups_and_report_a_skipped_step() -> None:
    alg = _algorithm(dynamicSampling=True)
    samples = [Sample([5, 6], [7] * n, [-1.0] * n, 1.0) for n in (1, 2, 3, 4)]
    some = experiment_rows("e", 1, alg, 2, samples, [1.0, 1.0, 0.0, 1.0])
    assert [len(r.completion_ids) for r in some.rows] == [3, 4] and not some.skipped
    assert some.rows[0].advantage < 0 < some.rows[1].advantage
    none = experiment_rows("e", 1, alg, 2, samples, [1.0, 1.0, 0.5, 0.5])
    assert none.skipped and none.step.dropped_groups == 2


# ---- the loss -------------------------------------------------------------------------


def test_clip_higher_widens_only_the_upper_bound() -> None:
    old = torch.tensor([[-2.0]])
    for log_ratio, adv, clip_high, grad in [
        (math.log(1.25), 1.0, None, 0.0),  # 1.25 > 1.2: clipped
        (math.log(1.25), 1.0, 0.28, -1.25),  # 1.25 < 1.28: a gradient
        (math.log(1.3), 1.0, 0.28, 0.0),  # above 1.28 again
        (math.log(0.75), -1.0, 0.28, 0.0),  # the lower bound stays 1 - clip
    ]:
        logp = (old + log_ratio).clone().requires_grad_(True)
        out = grpo_loss(logp, old, None, torch.tensor([adv]), torch.ones(1, 1), 0.2, 0.0,
                        clip_high=clip_high)  # fmt: skip
        out.seq_loss.sum().backward()
        assert logp.grad.item() == pytest.approx(grad, abs=TOL)


def test_gspo_clips_the_sequences_geometric_mean_ratio() -> None:
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0]])
    logp = (old + torch.tensor([[0.1, 0.3, 5.0]])).requires_grad_(True)  # token 3 masked
    clipped = grpo_loss(logp, old, None, torch.ones(1), mask, 0.2, sequence_ratio=True)
    assert clipped.clip_fraction.item() == 1.0  # e^0.2 = 1.221 > 1.2 on both tokens
    out = grpo_loss(logp, old, None, torch.ones(1), mask, 0.2, clip_high=0.3, sequence_ratio=True)
    assert out.seq_loss.item() == pytest.approx(-math.exp(0.2), abs=TOL)
    assert out.ratio_mean.item() == pytest.approx(math.exp(0.2), abs=TOL)
    out.seq_loss.sum().backward()
    # d(-exp(mean of the two log-ratios)) / d logp_t = -exp(0.2) / 2 on each unmasked token
    want = torch.tensor([[-math.exp(0.2) / 2, -math.exp(0.2) / 2, 0.0]])
    assert torch.allclose(logp.grad, want, atol=TOL)


def test_kl_estimators_k1_and_k3() -> None:
    logp = torch.tensor([[-1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5]])
    k1 = kl_per_token(logp, ref, "k1")
    assert k1.item() == pytest.approx(0.5, abs=TOL)
    (g1,) = torch.autograd.grad(k1.sum(), logp)
    k3 = kl_per_token(logp, ref, "k3")
    assert k3.item() == pytest.approx(math.exp(-0.5) - 0.5, abs=TOL)
    (g3,) = torch.autograd.grad(k3.sum(), logp)
    assert g1.item() == pytest.approx(1.0) and g3.item() == pytest.approx(1 - math.exp(-0.5))
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_per_token(logp, ref, "k2")


def _inputs() -> tuple[torch.Tensor, LossInputs]:
    # On-policy (ratio 1): token loss = -A. Row 0: A = 2 on 2 tokens, row 1: A = -1 on 1.
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    return logp, LossInputs(logp, logp.detach(), torch.tensor([2.0, -1.0]), mask)


@pytest.mark.parametrize(
    ("aggregation", "divisor", "want"),
    [
        ("seq-mean-token-mean", None, [-2.0, 1.0]),  # each row's token mean
        ("seq-mean-token-sum-norm", 4.0, [-4.0 / 4, 1.0 / 4]),  # sums over maxNewTokens
    ],
)
def test_aggregations_per_sequence(aggregation: str, divisor: float | None, want: list) -> None:
    _, inputs = _inputs()
    out = ClippedRatioLoss(aggregation=aggregation, token_divisor=divisor)(inputs)
    assert torch.allclose(out.seq_loss, torch.tensor(want), atol=TOL)


def test_token_mean_is_the_mean_over_the_steps_tokens() -> None:
    logp, inputs = _inputs()
    loss = ClippedRatioLoss(aggregation="token-mean").for_step([2, 1])
    assert loss.token_divisor == 1.5
    out = loss(inputs)
    # train/step.py weighs each row 1 / rows: the loss is (-2 - 2 + 1) / 3 tokens.
    total = out.seq_loss.sum() / 2
    assert total.item() == pytest.approx(-1.0, abs=TOL)
    total.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-2, -2, 0], [1, 0, 0]]) / 3.0, atol=TOL)
    with pytest.raises(ValueError, match="token-mean needs token_divisor"):
        ClippedRatioLoss(aggregation="token-mean")(inputs)


def test_step_loss_counts_the_kept_rows_tokens() -> None:
    alg = build_algorithm(AlgorithmSpec.model_validate({"lossAggregation": "token-mean"}), 8)
    rows = experiment_rows(
        "e", 1, alg, 2, [Sample([1], [2] * n, [0.0] * n, 1.0) for n in (1, 3)], [0.0, 1.0]
    ).rows
    assert step_loss(alg, rows).token_divisor == 2.0
    plain = build_algorithm(AlgorithmSpec(), 8)
    assert step_loss(plain, rows) is plain.loss


def test_the_recipes_build_their_settings() -> None:
    dapo = parse_spec({
        "task": {"name": "copy"},
        "algorithm": {"clipHigh": 0.28, "lossAggregation": "token-mean",
                      "dynamicSampling": True, "overlong": {"bufferTokens": 16, "penalty": 0.5}},
        "rollout": {"maxNewTokens": 64},
    })  # fmt: skip
    alg = build_algorithm(dapo.algorithm, dapo.rollout.max_new_tokens)
    assert alg.loss == ClippedRatioLoss(clip=0.2, clip_high=0.28, aggregation="token-mean")
    assert alg.shaping == RewardShaping(64, 16, 0.5, True)
    dr = AlgorithmSpec.model_validate(
        {"scaleRewards": "none", "lossAggregation": "seq-mean-token-sum-norm"}
    )
    alg = build_algorithm(dr, 64)
    assert alg.loss.token_divisor == 64.0 and alg.advantages == GroupRelativeAdvantages(
        "grpo", "none"
    )
    gspo = AlgorithmSpec.model_validate(
        {"importanceSamplingLevel": "sequence", "clip": 3e-4, "clipHigh": 4e-4, "klCoef": 0.1,
         "klEstimator": "k1", "advantageEstimator": "rloo"}
    )  # fmt: skip
    alg = build_algorithm(gspo, 64)
    assert alg.loss.sequence_ratio and alg.loss.kl_estimator == "k1" and alg.loss.needs_reference
    assert alg.advantages == GroupRelativeAdvantages("rloo", "group")
