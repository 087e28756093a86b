"""The algorithm seam: an advantage estimator and a policy loss, each a frozen dataclass
whose fields are its typed settings.

An algorithm object travels whole: the tick builds it from the experiment's spec, the
fused backward calls it, and data-parallel ranks receive it pickled in rank 0's train
message, so a setting added to a loss reaches every rank without a copied field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from torch import Tensor


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

    def __call__(self, inputs: LossInputs) -> LossOutput: ...


class AdvantageEstimator(Protocol):
    """Rewards of one experiment's step (groups contiguous) to per-row advantages."""

    name: ClassVar[str]

    def __call__(self, rewards: Tensor, group_size: int) -> Tensor: ...


@dataclass(frozen=True)
class Algorithm:
    """What one experiment trains with: how advantages are estimated, and the loss."""

    name: str
    advantages: AdvantageEstimator
    loss: PolicyLoss
