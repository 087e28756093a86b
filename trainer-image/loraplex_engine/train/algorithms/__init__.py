"""RL algorithm registry: an experiment's ``spec.algorithm`` names one; the registry
builds it, with its typed settings, from the spec.

An algorithm is an advantage estimator and a policy loss (``base``); everything
model-side (rollouts, the fused forward) stays in the loop, so adding one means adding a
builder here and, where new, an estimator or a loss beside ``grpo``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

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
    from loraplex_engine.spec import AlgorithmSpec


def grpo(spec: AlgorithmSpec) -> Algorithm:
    tis = spec.tis_cap if spec.off_policy_correction == "tis" else None
    loss = ClippedRatioLoss(clip=spec.clip, kl_coef=spec.kl_coef, tis_cap=tis)
    return Algorithm("grpo", GroupNormalisedAdvantages(), loss)


ALGORITHMS: dict[str, Callable[[AlgorithmSpec], Algorithm]] = {"grpo": grpo}


def build_algorithm(spec: AlgorithmSpec) -> Algorithm:
    """The algorithm ``spec.name`` names, with ``spec``'s settings."""
    try:
        builder = ALGORITHMS[spec.name]
    except KeyError:
        raise KeyError(f"unknown algorithm {spec.name!r}; known: {sorted(ALGORITHMS)}") from None
    return builder(spec)


__all__ = [
    "ALGORITHMS",
    "AdvantageEstimator",
    "Algorithm",
    "ClippedRatioLoss",
    "GroupNormalisedAdvantages",
    "LossInputs",
    "LossOutput",
    "PolicyLoss",
    "build_algorithm",
    "group_advantages",
    "grpo_loss",
    "masked_seq_mean",
    "tis_weights",
    "token_logprobs",
]
