"""RL algorithm registry: an experiment's ``spec.algorithm`` names one; the registry
builds it, with its typed settings, from the spec.

An algorithm is an advantage estimator and a policy loss (``base``); everything
model-side (rollouts, the fused forward) stays in the loop, so adding one means adding a
builder here and, where new, an estimator or a loss beside ``grpo``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from loraplex_engine.train.algorithms.advantages import (
    GroupRelativeAdvantages,
    RewardShaping,
    StepAdvantages,
)
from loraplex_engine.train.algorithms.base import (
    AdvantageEstimator,
    Algorithm,
    LossInputs,
    LossOutput,
    PolicyLoss,
)
from loraplex_engine.train.algorithms.grpo import (
    ClippedRatioLoss,
    GroupNormalisedAdvantages,
    group_advantages,
    grpo_loss,
    masked_seq_mean,
    tis_weights,
    token_logprobs,
)

if TYPE_CHECKING:  # the training core runs without pydantic (the GPU bench): types only
    from loraplex_engine.spec.experiment import AlgorithmSpec


def grpo(spec: AlgorithmSpec, max_new_tokens: int) -> Algorithm:
    """The GRPO family, its members picked by the settings (docs/algorithms.md)."""
    tis = spec.tis_cap if spec.off_policy_correction == "tis" else None
    sum_norm = spec.loss_aggregation == "seq-mean-token-sum-norm"
    loss = ClippedRatioLoss(
        clip=spec.clip,
        kl_coef=spec.kl_coef,
        tis_cap=tis,
        clip_high=spec.clip_high,
        sequence_ratio=spec.importance_sampling_level == "sequence",
        kl_estimator=spec.kl_estimator,
        aggregation=spec.loss_aggregation,
        token_divisor=float(max_new_tokens) if sum_norm else None,
    )
    overlong = spec.overlong
    shaping = RewardShaping(
        max_tokens=max_new_tokens,
        overlong_buffer=None if overlong is None else overlong.buffer_tokens,
        overlong_penalty=1.0 if overlong is None else overlong.penalty,
        drop_zero_variance=spec.dynamic_sampling,
    )
    advantages = GroupRelativeAdvantages(spec.advantage_estimator, spec.scale_rewards)
    return Algorithm("grpo", advantages, loss, shaping)


ALGORITHMS: dict[str, Callable[[AlgorithmSpec, int], Algorithm]] = {"grpo": grpo}


def build_algorithm(spec: AlgorithmSpec, max_new_tokens: int) -> Algorithm:
    """The algorithm ``spec.name`` names, with ``spec``'s settings; ``max_new_tokens``
    (the rollout's) for the settings that measure a completion against it."""
    try:
        builder = ALGORITHMS[spec.name]
    except KeyError:
        raise KeyError(f"unknown algorithm {spec.name!r}; known: {sorted(ALGORITHMS)}") from None
    return builder(spec, max_new_tokens)


__all__ = [
    "ALGORITHMS",
    "AdvantageEstimator",
    "Algorithm",
    "ClippedRatioLoss",
    "GroupNormalisedAdvantages",
    "GroupRelativeAdvantages",
    "LossInputs",
    "LossOutput",
    "PolicyLoss",
    "RewardShaping",
    "StepAdvantages",
    "build_algorithm",
    "group_advantages",
    "grpo_loss",
    "masked_seq_mean",
    "tis_weights",
    "token_logprobs",
]
