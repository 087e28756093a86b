"""Token-level losses as the Tinker protocol defines them (``tinker.types.LossFnType``),
for models a client trains itself (clients/, spec/training_service.py).

Unlike GRPO's loss (grpo.py: a masked mean per sequence, a mean over sequences), these
are **sums over tokens**: a datum's loss is the sum of its ``elementwise_loss`` and a
call's loss the sum over its data, so gradients add up across ``forward_backward`` calls
exactly as Tinker's do. Each loss maps one datum's per-token log-probs of its
``target_tokens`` (with the graph) and its loss inputs to an elementwise loss ``[N]``:

- ``cross_entropy``: ``-logp * weights``;
- ``importance_sampling``: ``-exp(logp - sampling_logp) * advantages``;
- ``ppo``: ``-min(r * A, clamp(r, low, high) * A)``, ``r = exp(logp - sampling_logp)``,
  thresholds ``clip_low_threshold``/``clip_high_threshold`` (default 0.8 / 1.2);
- ``cispo``: ``-sg(clamp(r, low, high)) * logp * A`` (the clipped ratio is a constant
  weight, so every token keeps a gradient);
- ``dro``: ``-(logp * A - beta / 2 * (logp - sampling_logp)^2)``, ``beta`` (default 0.05);
- ``gspo`` (GSPO-token): ppo's clipped objective on a *sequence* ratio ``s`` (the geometric
  mean of the token ratios over the positions ``sequence_ratio_mask`` marks), each token
  carrying ``s``'s value with its own log-prob's gradient:
  ``s_t = exp(sg(mean_M(logp - sampling_logp)) + logp - sg(logp))``;
- ``stable_reinforce`` (this engine's reading: the SDK names its inputs, not its formula):
  importance-sampled REINFORCE on the log-probs the engine *recorded* when it sampled
  each token (``q``, never the client's), on the targets its provenance names as sampled
  (``m``), with an optional ``kl_coeff`` (default 0) on the k3 estimate of KL(sampler ||
  policy): ``r = exp(logp - sg(q))``, ``m_t * (-r * A + kl_coeff * (r - 1 - log r))``.

Each is a frozen dataclass whose fields are its ``loss_fn_config`` settings;
:func:`build_token_loss` builds one by its SDK name, refusing an unknown name or key
(``KeyError``) and a bad value (``ValueError``), each naming what is wrong. Per-token
``clip_low_threshold``/``clip_high_threshold`` loss inputs override the config's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from loraplex_engine.train.algorithms.grpo import clipped_surrogate


@dataclass(frozen=True)
class TokenLossInputs:
    """One datum, ``[N]`` each: the policy's log-probs of its targets (with the graph) and
    its loss inputs (absent ones None; the caller checked the loss's ``required``)."""

    logprobs: Tensor
    weights: Tensor | None = None
    advantages: Tensor | None = None
    sampling_logprobs: Tensor | None = None  # the SDK's ``logprobs`` loss input
    clip_low: Tensor | None = None
    clip_high: Tensor | None = None
    sequence_mask: Tensor | None = None  # the SDK's ``sequence_ratio_mask`` (gspo)
    sampled_mask: Tensor | None = None  # 1 where the engine recorded the sampled target


class TokenLoss(Protocol):
    name: ClassVar[str]
    # Loss inputs a datum must carry (SDK names), beyond ``target_tokens``.
    required: ClassVar[tuple[str, ...]]

    def __call__(self, inputs: TokenLossInputs) -> Tensor:
        """The elementwise loss ``[N]`` (to minimise; the loss is its sum)."""
        ...


def _ratio(inputs: TokenLossInputs) -> Tensor:
    assert inputs.sampling_logprobs is not None
    return torch.exp(inputs.logprobs - inputs.sampling_logprobs.detach())


def _adv(inputs: TokenLossInputs) -> Tensor:
    assert inputs.advantages is not None
    return inputs.advantages.to(inputs.logprobs.dtype)


@dataclass(frozen=True)
class CrossEntropy:
    name: ClassVar[str] = "cross_entropy"
    required: ClassVar[tuple[str, ...]] = ()  # weights: 1 where absent

    def __call__(self, inputs: TokenLossInputs) -> Tensor:
        w = inputs.weights
        return -inputs.logprobs * (1.0 if w is None else w.to(inputs.logprobs.dtype))


@dataclass(frozen=True)
class ImportanceSampling:
    name: ClassVar[str] = "importance_sampling"
    required: ClassVar[tuple[str, ...]] = ("logprobs", "advantages")

    def __call__(self, inputs: TokenLossInputs) -> Tensor:
        return -_ratio(inputs) * _adv(inputs)


@dataclass(frozen=True)
class _Clipped:
    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.2

    def __post_init__(self) -> None:
        low, high = self.clip_low_threshold, self.clip_high_threshold
        if not 0.0 <= low <= high:
            raise ValueError(f"clip_low_threshold: needs 0 <= low <= high, got {low}, {high}")

    def bounds(self, inputs: TokenLossInputs) -> tuple[float | Tensor, float | Tensor]:
        low = self.clip_low_threshold if inputs.clip_low is None else inputs.clip_low
        high = self.clip_high_threshold if inputs.clip_high is None else inputs.clip_high
        return low, high


@dataclass(frozen=True)
class PPO(_Clipped):
    name: ClassVar[str] = "ppo"
    required: ClassVar[tuple[str, ...]] = ("logprobs", "advantages")

    def __call__(self, inputs: TokenLossInputs) -> Tensor:
        objective, _ = clipped_surrogate(_ratio(inputs), _adv(inputs), *self.bounds(inputs))
        return -objective


@dataclass(frozen=True)
class CISPO(_Clipped):
    name: ClassVar[str] = "cispo"
    required: ClassVar[tuple[str, ...]] = ("logprobs", "advantages")

    def __call__(self, inputs: TokenLossInputs) -> Tensor:
        weight = torch.clamp(_ratio(inputs), *self.bounds(inputs)).detach()
        return -weight * inputs.logprobs * _adv(inputs)


@dataclass(frozen=True)
class DRO:
    name: ClassVar[str] = "dro"
    required: ClassVar[tuple[str, ...]] = ("logprobs", "advantages")
    beta: float = 0.05

    def __post_init__(self) -> None:
        if not self.beta >= 0.0:
            raise ValueError(f"beta: must be >= 0, got {self.beta}")

    def __call__(self, inputs: TokenLossInputs) -> Tensor:
        assert inputs.sampling_logprobs is not None
        delta = inputs.logprobs - inputs.sampling_logprobs.detach()
        return -(inputs.logprobs * _adv(inputs) - 0.5 * self.beta * delta.pow(2))


@dataclass(frozen=True)
class GSPO(_Clipped):
    """Clip thresholds bound the ratio itself (as ppo's do), defaults 0.8 / 1.2."""

    name: ClassVar[str] = "gspo"
    required: ClassVar[tuple[str, ...]] = ("logprobs", "advantages", "sequence_ratio_mask")

    def __call__(self, inputs: TokenLossInputs) -> Tensor:
        assert inputs.sampling_logprobs is not None and inputs.sequence_mask is not None
        lp = inputs.logprobs
        in_ratio = inputs.sequence_mask != 0  # the caller checked it marks a token
        log_ratio = (lp.detach() - inputs.sampling_logprobs.detach())[in_ratio].mean()
        ratio = torch.exp(log_ratio + lp - lp.detach())
        objective, _ = clipped_surrogate(ratio, _adv(inputs), *self.bounds(inputs))
        return -objective


@dataclass(frozen=True)
class StableReinforce:
    """``sampling_logprobs`` here are the engine's recorded ones (clients/inputs.py puts
    them there from the datum's ``recorded``): a target not sampled carries no loss."""

    name: ClassVar[str] = "stable_reinforce"
    required: ClassVar[tuple[str, ...]] = ("advantages",)  # and provenance (recorded)
    kl_coeff: float = 0.0

    def __post_init__(self) -> None:
        if not self.kl_coeff >= 0.0:
            raise ValueError(f"kl_coeff: must be >= 0, got {self.kl_coeff}")

    def __call__(self, inputs: TokenLossInputs) -> Tensor:
        assert inputs.sampling_logprobs is not None and inputs.sampled_mask is not None
        log_ratio = inputs.logprobs - inputs.sampling_logprobs.detach()
        ratio = torch.exp(log_ratio)
        loss = -ratio * _adv(inputs)
        if self.kl_coeff > 0.0:
            loss = loss + self.kl_coeff * (ratio - 1.0 - log_ratio)
        return loss * inputs.sampled_mask.to(loss.dtype)


TOKEN_LOSSES: dict[str, Callable[..., TokenLoss]] = {
    loss.name: loss
    for loss in (CrossEntropy, ImportanceSampling, PPO, CISPO, DRO, GSPO, StableReinforce)
}


def build_token_loss(name: str, config: Mapping[str, object] | None = None) -> TokenLoss:
    """The loss ``name`` with ``config``'s settings. ``KeyError(what)``: an unknown loss
    (``"loss_fn"``) or config key (``"loss_fn_config.<key>"``); ``ValueError("<key>:
    ...")``: a value out of range or not a finite number."""
    cls = TOKEN_LOSSES.get(name)
    if cls is None:
        raise KeyError("loss_fn")
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    settings: dict[str, float] = {}
    for key, value in (config or {}).items():
        if key not in known:
            raise KeyError(f"loss_fn_config.{key}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key}: must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{key}: must be finite, got {value!r}")
        settings[key] = float(value)
    return cls(**settings)
