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

The GRPO family (docs/algorithms.md) shares this loss through its settings, named as
TRL's ``GRPOConfig`` and verl's actor config name them:

- ``clip_high`` (DAPO's clip-higher; TRL ``epsilon_high``): the ratio's upper bound
  ``1 + clip_high`` apart from the lower ``1 - clip``;
- ``sequence_ratio`` (GSPO; TRL ``importance_sampling_level="sequence"``): one ratio per
  sequence, ``exp(mean over its tokens of (logp - old))``, clipped as a whole;
- ``kl_estimator``: ``k3`` (``exp(ref - logp) - (ref - logp) - 1``, TRL's, verl's
  ``low_var_kl``) or ``k1`` (``logp - ref``, verl's ``kl``);
- ``aggregation`` (verl ``loss_agg_mode``): how token losses become the loss,
  ``seq-mean-token-mean`` (above; TRL ``grpo``), ``token-mean`` (every token of the
  experiment's step weighs the same; DAPO, TRL ``dapo``) or ``seq-mean-token-sum-norm``
  (each sequence's token *sum* over ``maxNewTokens``: no length bias; Dr. GRPO, TRL
  ``dr_grpo``). The two sum-based ones divide by ``token_divisor``: the step's completion
  tokens per row (``for_step``) or ``maxNewTokens``, so that the step's weights of
  ``1 / rows`` (train/step.py) make the loss the sum over tokens over that normaliser.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
from torch import Tensor

from loraplex_engine.train.algorithms.base import LossInputs, LossOutput

KLEstimator = Literal["k1", "k3"]
LossAggregation = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k3")
LOSS_AGGREGATIONS: tuple[str, ...] = (
    "seq-mean-token-mean",
    "token-mean",
    "seq-mean-token-sum-norm",
)


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


def kl_per_token(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(policy || ref) from the sampled tokens (Schulman's k1/k3).

    k3 is unbiased and never negative; k1 (the plain log-ratio) is unbiased too but
    negative on some tokens, with the lower-variance gradient of the two as a penalty.
    """
    if estimator == "k1":
        return logprobs - ref_logprobs.detach()
    if estimator == "k3":
        delta = ref_logprobs.detach() - logprobs
        return torch.exp(delta) - delta - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; known: {list(KL_ESTIMATORS)}")


def aggregate(token_loss: Tensor, mask: Tensor, token_divisor: float | None) -> Tensor:
    """Per-sequence loss ``[B]``: the masked token mean (``token_divisor`` None), else the
    masked token sum over ``token_divisor`` (module docstring: aggregation)."""
    if token_divisor is None:
        return masked_seq_mean(token_loss, mask)
    if not token_divisor > 0:
        raise ValueError(f"token_divisor must be positive, got {token_divisor}")
    return (token_loss * mask.to(token_loss.dtype)).sum(dim=1) / token_divisor


def log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, sequence: bool) -> Tensor:
    """Log importance ratio per token ``[B, T]``, or per sequence ``[B, 1]`` (GSPO: the
    masked mean of the token log-ratios, a geometric mean of the token ratios)."""
    delta = logprobs - old_logprobs.detach()
    if not sequence:
        return delta
    m = mask.to(delta.dtype)
    return ((delta * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)).unsqueeze(1)


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
    clip_high: float | None = None,
    sequence_ratio: bool = False,
    kl_estimator: str = "k3",
    token_divisor: float | None = None,
) -> LossOutput:
    """PPO-style clipped surrogate with an optional KL penalty to the reference.

    Shapes: log-probs and mask ``[B, T]`` (mask 1 on completion tokens),
    advantages ``[B]``. Returns the loss to *minimise*. With ``tis_cap`` and the
    sampler's ``behaviour_logprobs``, each token's policy-gradient term is multiplied by
    its TIS weight (``tis_weights``); the KL penalty is not (it is a regulariser of the
    current policy, not an estimate over the sampler's tokens: verl leaves it unweighted).
    ``clip_high`` (None: ``clip``), ``sequence_ratio``, ``kl_estimator`` and
    ``token_divisor``: the module docstring.
    """
    adv = advantages.to(logprobs.dtype).unsqueeze(1)
    high = clip if clip_high is None else clip_high
    ratio = torch.exp(log_ratio(logprobs, old_logprobs, mask, sequence_ratio))
    objective, clipped_active = clipped_surrogate(ratio, adv, 1.0 - clip, 1.0 + high)
    token_loss = -objective.expand_as(logprobs)
    clipped_active = clipped_active.expand_as(logprobs)
    ratio = ratio.expand_as(logprobs)
    tis = None
    if tis_cap is not None:
        if behaviour_logprobs is None:
            raise ValueError("TIS needs the sampler's (behaviour) log-probs")
        tis = tis_weights(old_logprobs, behaviour_logprobs, tis_cap)
        token_loss = token_loss * tis
    if ref_logprobs is not None:
        kl_tok = kl_per_token(logprobs, ref_logprobs, kl_estimator)
    else:
        kl_tok = torch.zeros_like(logprobs)
    if kl_coef:
        token_loss = token_loss + kl_coef * kl_tok
    return LossOutput(
        seq_loss=aggregate(token_loss, mask, token_divisor),
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
    """The GRPO family's loss (:func:`grpo_loss`): the clipped ratio (per token, or per
    sequence for GSPO), an optional KL to the base, truncated importance sampling when
    ``tis_cap`` is set, and the aggregation of token losses (module docstring)."""

    name: ClassVar[str] = "clipped-ratio"
    clip: float = 0.2
    kl_coef: float = 0.0
    tis_cap: float | None = None
    clip_high: float | None = None
    sequence_ratio: bool = False
    kl_estimator: str = "k3"
    aggregation: str = "seq-mean-token-mean"
    # token-mean: the step's completion tokens per row (``for_step``); seq-mean-token-sum-
    # norm: maxNewTokens (set at build); seq-mean-token-mean: None.
    token_divisor: float | None = None

    def __post_init__(self) -> None:
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator: unknown {self.kl_estimator!r}")
        if self.aggregation not in LOSS_AGGREGATIONS:
            raise ValueError(f"aggregation: unknown {self.aggregation!r}")

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    def for_step(self, completion_tokens: Sequence[int]) -> ClippedRatioLoss:
        """This loss for one step whose rows have ``completion_tokens`` tokens each (all of
        the experiment's rows, on every data-parallel rank)."""
        if self.aggregation != "token-mean" or not completion_tokens:
            return self
        per_row = sum(completion_tokens) / len(completion_tokens)
        return replace(self, token_divisor=max(per_row, 1.0))

    def __call__(self, inputs: LossInputs) -> LossOutput:
        divisor = self.token_divisor
        if self.aggregation == "seq-mean-token-mean":
            divisor = None
        elif divisor is None:
            raise ValueError(f"{self.aggregation} needs token_divisor (for_step, or maxNewTokens)")
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
            clip_high=self.clip_high,
            sequence_ratio=self.sequence_ratio,
            kl_estimator=self.kl_estimator,
            token_divisor=divisor,
        )
