"""From one experiment's step rewards to per-row advantages: the GRPO family's estimators
and DAPO's reward-side pieces (overlong shaping, the dynamic-sampling filter).

Pure tensor code. ``rewards`` is flat ``[n_groups * group_size]``, groups contiguous
(the ``groupSize`` completions of one prompt), as the tick lays a step out.

- **Baselines** (``estimator``): ``grpo`` subtracts the group's mean; ``rloo`` the mean
  of the *other* completions of the group (leave-one-out, as verl's ``rloo`` and TRL's
  RLOO trainer), which is the grpo baseline's centring scaled by ``G / (G - 1)``.
- **Scaling** (``scale``, TRL's ``scale_rewards``): ``group`` divides by the group's
  standard deviation (GRPO), ``batch`` by the whole step's, ``none`` not at all
  (Dr. GRPO: the std division over-weights groups that are nearly all right or all
  wrong). Population std (``unbiased=False``: ``groupSize`` 2 stays well defined) plus
  1e-6; TRL uses the sample std plus 1e-4, which is why the parity test
  (tests/engine/train/test_trl_parity.py) compares losses on given advantages.
- **Overlong shaping** (DAPO's soft overlong punishment, TRL's
  ``get_soft_overlong_punishment``, verl's ``overlong_buffer``): a completion of ``L``
  tokens out of ``max_tokens`` loses ``penalty * (L - (max_tokens - buffer)) / buffer``
  once it enters the last ``buffer`` tokens, so ``penalty`` at the limit (a truncated
  completion); added to the reward before the advantages.
- **Dynamic sampling** (DAPO's filter, verl's ``filter_groups``): a group whose (shaped)
  rewards are all equal carries no signal; ``drop_zero_variance`` drops its rows from
  the update. DAPO then samples more prompts to refill the batch; here the step trains
  on the groups that remain (or skips the update when none does: the tick reports it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

AdvantageName = Literal["grpo", "rloo"]
ScaleRewards = Literal["group", "batch", "none"]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo")
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
STD_EPS = 1e-6


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} "
            f"entries, got shape {tuple(rewards.shape)}"
        )
    return rewards.float().view(-1, group_size)


def centred_rewards(rewards: Tensor, group_size: int, estimator: str = "grpo") -> Tensor:
    """Each reward minus its baseline (module docstring), flat ``[N]``."""
    grouped = _grouped(rewards, group_size)
    if estimator == "grpo":
        baseline = grouped.mean(dim=1, keepdim=True)
    elif estimator == "rloo":
        if group_size < 2:
            raise ValueError("rloo needs group_size >= 2 (a leave-one-out baseline)")
        baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    return (grouped - baseline).view(-1)


def scaled_advantages(
    rewards: Tensor, group_size: int, estimator: str = "grpo", scale: str = "group"
) -> Tensor:
    """Centred rewards over the std ``scale`` names (module docstring)."""
    centred = centred_rewards(rewards, group_size, estimator)
    grouped = _grouped(rewards, group_size)
    if scale == "none":
        return centred
    if scale == "group":
        std = grouped.std(dim=1, unbiased=False, keepdim=True).expand_as(grouped).reshape(-1)
    elif scale == "batch":
        std = grouped.reshape(-1).std(unbiased=False).expand(centred.shape)
    else:
        raise ValueError(f"unknown reward scaling {scale!r}")
    return centred / (std + STD_EPS)


def zero_variance_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Per group, bool ``[n_groups]``: every reward of the group is equal."""
    grouped = _grouped(rewards, group_size)
    return grouped.amax(dim=1) == grouped.amin(dim=1)


def overlong_penalty(lengths: Tensor, max_tokens: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment per completion (<= 0), module docstring."""
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"overlong buffer must be in (0, max_tokens={max_tokens}], got {buffer}")
    over = (lengths.float() - (max_tokens - buffer)) / buffer
    return -penalty * over.clamp(min=0.0, max=1.0)


@dataclass(frozen=True)
class GroupRelativeAdvantages:
    """The family's estimator: a group baseline (``grpo`` mean or ``rloo`` leave-one-out)
    and a std scaling (``group``, ``batch`` or ``none``)."""

    name: ClassVar[str] = "group-relative"
    estimator: str = "grpo"
    scale: str = "group"

    def __post_init__(self) -> None:
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"estimator: unknown {self.estimator!r}")
        if self.scale not in SCALE_REWARDS:
            raise ValueError(f"scale: unknown {self.scale!r}")

    def __call__(self, rewards: Tensor, group_size: int) -> Tensor:
        return scaled_advantages(rewards, group_size, self.estimator, self.scale)


@dataclass(frozen=True)
class StepAdvantages:
    """One step's rows: their advantages, which of them train, and what shaping did."""

    advantages: Tensor  # [N]
    keep: Tensor  # bool [N]: False on the rows of a dropped (zero-variance) group
    rewards: Tensor  # [N]: the shaped rewards the advantages were computed from
    dropped_groups: int  # groups the dynamic-sampling filter dropped

    @property
    def all_dropped(self) -> bool:
        return not bool(self.keep.any())


@dataclass(frozen=True)
class RewardShaping:
    """DAPO's reward-side settings: overlong shaping (``overlong_buffer`` tokens before
    ``max_tokens``, None: off) and the zero-variance filter."""

    max_tokens: int = 0
    overlong_buffer: int | None = None
    overlong_penalty: float = 1.0
    drop_zero_variance: bool = False

    def shaped(self, rewards: Tensor, lengths: Sequence[int]) -> Tensor:
        rewards = rewards.float()
        if self.overlong_buffer is None:
            return rewards
        if len(lengths) != rewards.numel():
            raise ValueError(f"{len(lengths)} lengths for {rewards.numel()} rewards")
        return rewards + overlong_penalty(
            torch.tensor(lengths), self.max_tokens, self.overlong_buffer, self.overlong_penalty
        )

    def dropped(self, shaped: Tensor, group_size: int) -> Tensor:
        """Per group, bool: the filter drops it (zero variance, when the filter is on)."""
        flat = zero_variance_groups(shaped, group_size)
        return flat if self.drop_zero_variance else torch.zeros_like(flat)
