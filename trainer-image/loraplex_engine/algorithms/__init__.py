"""RL algorithm registry: the loop looks an algorithm up by ``spec.algorithm.name``.

An algorithm turns rewards into advantages and (log-probs, advantages) into a
per-sequence loss; everything model-side (rollouts, the fused forward) stays in
the loop, so adding one means adding a small class here.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from loraplex_engine.algorithms.grpo import (
    LossOutput,
    group_advantages,
    grpo_loss,
    masked_seq_mean,
    tis_weights,
    token_logprobs,
)


class Algorithm(Protocol):
    name: str

    def advantages(self, rewards: Tensor, group_size: int) -> Tensor: ...

    def loss(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        ref_logprobs: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
        *,
        clip: float,
        kl_coef: float,
        behaviour_logprobs: Tensor | None = None,
        tis_cap: float | None = None,
    ) -> LossOutput: ...


class GRPO:
    """Group-relative advantages (std-normalised) + clipped ratio + optional k3 KL."""

    name = "grpo"

    def advantages(self, rewards: Tensor, group_size: int) -> Tensor:
        return group_advantages(rewards, group_size)

    def loss(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        ref_logprobs: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
        *,
        clip: float,
        kl_coef: float,
        behaviour_logprobs: Tensor | None = None,
        tis_cap: float | None = None,
    ) -> LossOutput:
        return grpo_loss(
            logprobs,
            old_logprobs,
            ref_logprobs,
            advantages,
            mask,
            clip,
            kl_coef,
            behaviour_logprobs=behaviour_logprobs,
            tis_cap=tis_cap,
        )


ALGORITHMS: dict[str, Algorithm] = {"grpo": GRPO()}


def get_algorithm(name: str) -> Algorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise KeyError(f"unknown algorithm {name!r}; known: {sorted(ALGORITHMS)}") from None


__all__ = [
    "ALGORITHMS",
    "GRPO",
    "Algorithm",
    "LossOutput",
    "get_algorithm",
    "group_advantages",
    "grpo_loss",
    "masked_seq_mean",
    "tis_weights",
    "token_logprobs",
]
