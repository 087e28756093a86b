"""GRPO maths: group-relative advantages and the clipped-ratio policy loss.

Pure tensor code (no model): the loop hands in per-token log-probabilities and a
mask, and gets back one loss per sequence plus statistics.

Normalisation choice: each sequence's loss is the masked *mean* over its own
completion tokens, and an experiment's loss is the mean over its sequences
("sequence-mean" as in the GRPO paper). A long completion therefore weighs the
same as a short one, and the loss scale does not depend on ``maxNewTokens``.

Off-policy correction: when the sampler is not the trainer (vLLM, another kernel and
precision), the trainer recomputes the old log-probs itself (so the PPO ratio starts at 1
under the trainer's own numerics) and ``tis_weights`` reweights each token by the truncated
ratio of trainer to sampler, ``min(exp(old - behaviour), cap)`` (truncated importance
sampling, TIS), as verl's ``compute_policy_loss_vanilla`` (``tis_imp_ratio_cap``) and
SkyRL's ``off_policy_correction`` (token level, ``token_tis_ratio_clip_high``) do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from loraplex_engine.train.algorithms.base import LossInputs, LossOutput


def group_advantages(
    rewards: Tensor, group_size: int, eps: float = 1e-6, normalize_std: bool = True
) -> Tensor:
    """Advantage of each completion relative to its group (same prompt).

    ``rewards`` is flat ``[n_groups * group_size]``, groups contiguous.
    A group whose rewards are all equal gets zero advantage (nothing to learn).
    """
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} "
            f"entries, got shape {tuple(rewards.shape)}"
        )
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        # Population std (unbiased=False) keeps group_size=2 well defined.
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred.view(-1)


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(target) per position: logits ``[B, T, V]``, targets ``[B, T]`` → ``[B, T]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def masked_seq_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over each row's masked tokens; rows with no tokens give 0."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def _masked_scalar_mean(values: Tensor, mask: Tensor) -> Tensor:
    mask = mask.to(values.dtype)
    return ((values * mask).sum() / mask.sum().clamp(min=1.0)).detach()


def tis_weights(old_logprobs: Tensor, behaviour_logprobs: Tensor, cap: float) -> Tensor:
    """Truncated importance weight of each token, ``min(exp(old - behaviour), cap)``.

    ``old``: the trainer's log-prob of the sampled token before the update; ``behaviour``:
    the sampler's. No gradient flows through it (both are constants of the step). Only the
    upper side is truncated (verl, SkyRL): a token the sampler over-weighted gets a weight
    below 1, one it under-weighted up to ``cap``, which bounds the variance.
    """
    if cap < 1.0:
        raise ValueError(f"the TIS cap must be at least 1, got {cap}")
    return torch.exp(old_logprobs.detach() - behaviour_logprobs.detach()).clamp(max=cap)


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, low: float | Tensor, high: float | Tensor
) -> tuple[Tensor, Tensor]:
    """PPO's clipped objective per token, ``min(ratio * A, clamp(ratio, low, high) * A)``
    (to maximise), and where the clip was active (bool). GRPO's loss (``low = 1 - clip``)
    and Tinker's ``ppo`` (train/algorithms/tinker_losses.py) share it."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, low, high) * advantages
    # min() picks the pessimistic bound: outside the trust region the clipped
    # branch is constant, so the token contributes no gradient.
    # Active = the constant clipped branch won the min (token gives no gradient).
    return torch.minimum(unclipped, clipped), clipped < unclipped


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    clip: float = 0.2,
    kl_coef: float = 0.0,
    behaviour_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
) -> LossOutput:
    """PPO-style clipped surrogate with an optional k3 KL penalty to the reference.

    Shapes: log-probs and mask ``[B, T]`` (mask 1 on completion tokens),
    advantages ``[B]``. Returns the loss to *minimise*. With ``tis_cap`` and the
    sampler's ``behaviour_logprobs``, each token's policy-gradient term is multiplied by
    its TIS weight (``tis_weights``); the KL penalty is not (it is a regulariser of the
    current policy, not an estimate over the sampler's tokens: verl leaves it unweighted).
    """
    adv = advantages.to(logprobs.dtype).unsqueeze(1)
    ratio = torch.exp(logprobs - old_logprobs.detach())
    objective, clipped_active = clipped_surrogate(ratio, adv, 1.0 - clip, 1.0 + clip)
    token_loss = -objective
    tis = None
    if tis_cap is not None:
        if behaviour_logprobs is None:
            raise ValueError("TIS needs the sampler's (behaviour) log-probs")
        tis = tis_weights(old_logprobs, behaviour_logprobs, tis_cap)
        token_loss = token_loss * tis
    if ref_logprobs is not None:
        delta = ref_logprobs.detach() - logprobs
        kl_tok = torch.exp(delta) - delta - 1.0  # k3: unbiased, always >= 0
    else:
        kl_tok = torch.zeros_like(logprobs)
    if kl_coef:
        token_loss = token_loss + kl_coef * kl_tok
    return LossOutput(
        seq_loss=masked_seq_mean(token_loss, mask),
        clip_fraction=_masked_scalar_mean(clipped_active.to(logprobs.dtype), mask),
        kl=_masked_scalar_mean(kl_tok.detach(), mask),
        ratio_mean=_masked_scalar_mean(ratio.detach(), mask),
        tis_mean=None if tis is None else _masked_scalar_mean(tis, mask),
    )


@dataclass(frozen=True)
class GroupNormalisedAdvantages:
    """GRPO's estimator: each reward against its group's mean, over the group's std."""

    name: ClassVar[str] = "group-normalised"
    normalize_std: bool = True

    def __call__(self, rewards: Tensor, group_size: int) -> Tensor:
        return group_advantages(rewards, group_size, normalize_std=self.normalize_std)


@dataclass(frozen=True)
class ClippedRatioLoss:
    """GRPO's loss (:func:`grpo_loss`): the clipped ratio, an optional k3 KL to the base,
    and truncated importance sampling when ``tis_cap`` is set."""

    name: ClassVar[str] = "clipped-ratio"
    clip: float = 0.2
    kl_coef: float = 0.0
    tis_cap: float | None = None

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    def __call__(self, inputs: LossInputs) -> LossOutput:
        return grpo_loss(
            inputs.logprobs,
            inputs.old_logprobs,
            inputs.ref_logprobs,
            inputs.advantages,
            inputs.mask,
            self.clip,
            self.kl_coef,
            behaviour_logprobs=inputs.behaviour_logprobs,
            tis_cap=self.tis_cap,
        )
