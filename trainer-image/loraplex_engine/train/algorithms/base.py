"""The algorithm seam: an advantage estimator and a policy loss, each a frozen dataclass
whose fields are its typed settings.

An algorithm object travels whole: the tick builds it from the experiment's spec, the
fused backward calls it, and data-parallel ranks receive it pickled in rank 0's train
message, so a setting added to a loss reaches every rank without a copied field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from torch import Tensor

from loraplex_engine.train.algorithms.advantages import RewardShaping, StepAdvantages


@dataclass
class LossOutput:
    """``seq_loss`` carries the graph; the rest are detached statistics over the batch."""

    seq_loss: Tensor  # [B], masked token mean per sequence
    clip_fraction: Tensor  # scalar: share of tokens where the clip was active
    kl: Tensor  # scalar: mean k3 KL(policy || ref) over tokens (0 without ref)
    ratio_mean: Tensor  # scalar: mean importance ratio over tokens
    tis_mean: Tensor | None = None  # scalar: mean TIS weight over tokens (None: TIS off)


@dataclass(frozen=True)
class LossInputs:
    """One experiment's rows of a micro-batch. Log-probs and mask ``[B, T]`` (mask 1 on
    completion tokens), advantages ``[B]``."""

    logprobs: Tensor  # the policy's, with the graph
    old_logprobs: Tensor  # the trainer's before the update
    advantages: Tensor
    mask: Tensor
    ref_logprobs: Tensor | None = None  # the frozen base's, when the loss needs them
    behaviour_logprobs: Tensor | None = None  # the sampler's


class PolicyLoss(Protocol):
    """A loss to minimise, per sequence; its dataclass fields are its settings."""

    name: ClassVar[str]

    @property
    def needs_reference(self) -> bool:
        """Whether it reads ``ref_logprobs`` (the fused backward then runs the base)."""
        ...

    def for_step(self, completion_tokens: Sequence[int]) -> PolicyLoss:
        """This loss for one step of an experiment whose rows have ``completion_tokens``
        tokens each (a loss normalised over the step's tokens needs their total)."""
        ...

    def __call__(self, inputs: LossInputs) -> LossOutput: ...


class AdvantageEstimator(Protocol):
    """Rewards of one experiment's step (groups contiguous) to per-row advantages."""

    name: ClassVar[str]

    def __call__(self, rewards: Tensor, group_size: int) -> Tensor: ...


@dataclass(frozen=True)
class Algorithm:
    """What one experiment trains with: how rewards are shaped and filtered, how
    advantages are estimated, and the loss."""

    name: str
    advantages: AdvantageEstimator
    loss: PolicyLoss
    shaping: RewardShaping = field(default_factory=RewardShaping)

    def step_advantages(
        self, rewards: Tensor, lengths: Sequence[int], group_size: int
    ) -> StepAdvantages:
        """One step's rewards (completion ``lengths`` in tokens) to its rows' advantages
        and which rows train (train/algorithms/advantages.py)."""
        shaped = self.shaping.shaped(rewards, lengths)
        dropped = self.shaping.dropped(shaped, group_size)
        keep = (~dropped).repeat_interleave(group_size)
        advantages = self.advantages(shaped, group_size)
        return StepAdvantages(advantages, keep, shaped, int(dropped.sum()))
