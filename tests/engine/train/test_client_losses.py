"""Tinker's token-level losses (train/algorithms/tinker_losses.py) against hand-written
reference formulas on small tensors: sums over tokens, gradients included."""

from __future__ import annotations

import math

import pytest
import torch
from loraplex_engine.train.algorithms.grpo import grpo_loss
from loraplex_engine.train.algorithms.tinker_losses import (
    TokenLossInputs,
    build_token_loss,
)

LOGP = [-0.5, -1.2, -2.0, -0.1]
OLD = [-0.7, -1.0, -2.5, -0.1]
ADV = [1.0, -2.0, 0.5, 3.0]
W = [1.0, 0.0, 2.0, 1.0]


def _run(name: str, config: dict | None = None, **extra) -> tuple[list[float], list[float]]:
    """(elementwise loss, d sum / d logp) for the fixed tokens above."""
    logp = torch.tensor(LOGP, requires_grad=True)
    inputs = TokenLossInputs(
        logp,
        weights=torch.tensor(W),
        advantages=torch.tensor(ADV),
        sampling_logprobs=torch.tensor(OLD),
        **extra,
    )
    loss = build_token_loss(name, config)(inputs)
    loss.sum().backward()
    return loss.tolist(), logp.grad.tolist()


def _ratio(i: int) -> float:
    return math.exp(LOGP[i] - OLD[i])


def test_cross_entropy_is_the_weighted_negative_logprob_sum() -> None:
    loss, grad = _run("cross_entropy")
    assert loss == pytest.approx([-lp * w for lp, w in zip(LOGP, W, strict=True)])
    assert grad == pytest.approx([-w for w in W])


def test_importance_sampling() -> None:
    loss, grad = _run("importance_sampling")
    assert loss == pytest.approx([-_ratio(i) * ADV[i] for i in range(4)])
    assert grad == pytest.approx([-_ratio(i) * ADV[i] for i in range(4)])  # d r / d logp = r


@pytest.mark.parametrize("low,high", [(0.8, 1.2), (0.9, 1.1)])
def test_ppo_clips_the_ratio(low: float, high: float) -> None:
    config = (
        {}
        if (low, high) == (0.8, 1.2)
        else {"clip_low_threshold": low, "clip_high_threshold": high}
    )
    loss, grad = _run("ppo", config)
    for i in range(4):
        r, a = _ratio(i), ADV[i]
        unclipped, clipped = r * a, min(max(r, low), high) * a
        assert loss[i] == pytest.approx(-min(unclipped, clipped))
        assert grad[i] == pytest.approx(-r * a if unclipped <= clipped else 0.0)


def test_ppo_per_token_thresholds_override_the_config() -> None:
    loss, _ = _run(
        "ppo",
        {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01},
        clip_low=torch.full((4,), 0.1),
        clip_high=torch.full((4,), 10.0),
    )
    assert loss == pytest.approx([-_ratio(i) * ADV[i] for i in range(4)])  # nothing clipped


def test_cispo_weights_logp_by_the_clipped_ratio_without_its_gradient() -> None:
    loss, grad = _run("cispo")
    for i in range(4):
        c = min(max(_ratio(i), 0.8), 1.2)
        assert loss[i] == pytest.approx(-c * LOGP[i] * ADV[i])
        assert grad[i] == pytest.approx(-c * ADV[i])


def test_dro_quadratic_penalty() -> None:
    loss, grad = _run("dro", {"beta": 0.3})
    for i in range(4):
        d = LOGP[i] - OLD[i]
        assert loss[i] == pytest.approx(-(LOGP[i] * ADV[i] - 0.15 * d * d))
        assert grad[i] == pytest.approx(-(ADV[i] - 0.3 * d))


def test_grpo_still_matches_its_reference_after_sharing_the_clip() -> None:
    logp = torch.tensor([LOGP])
    out = grpo_loss(logp, torch.tensor([OLD]), None, torch.tensor([1.5]), torch.ones(1, 4), 0.2)
    ref = [-min(_ratio(i) * 1.5, min(max(_ratio(i), 0.8), 1.2) * 1.5) for i in range(4)]
    assert float(out.seq_loss) == pytest.approx(sum(ref) / 4)


@pytest.mark.parametrize(
    "name,config,what",
    [
        ("nope", {}, "loss_fn"),
        ("ppo", {"clip": 0.2}, "loss_fn_config.clip"),
        ("cross_entropy", {"beta": 1.0}, "loss_fn_config.beta"),
    ],
)
def test_unknown_loss_or_key_names_it(name: str, config: dict, what: str) -> None:
    with pytest.raises(KeyError) as e:
        build_token_loss(name, config)
    assert e.value.args[0] == what


@pytest.mark.parametrize(
    "config",
    [
        {"clip_low_threshold": 1.5},
        {"clip_high_threshold": float("nan")},
        {"clip_low_threshold": "x"},
    ],
)
def test_bad_values_name_their_key(config: dict) -> None:
    with pytest.raises(ValueError, match="clip_"):
        build_token_loss("ppo", config)


MASK = [0.0, 1.0, 1.0, 1.0]  # the sequence ratio over the last three tokens


def _gspo_reference(low: float, high: float) -> tuple[list[float], list[float]]:
    """Tinker's documented GSPO-token, by hand: s = exp(mean_M(logp - q)); each token's
    ratio has s's value and d s_t / d logp_t = s (its own log-prob's gradient only);
    loss_t = -min(s A_t, clip(s, low, high) A_t)."""
    masked = [LOGP[i] - OLD[i] for i in range(4) if MASK[i]]
    s = math.exp(sum(masked) / len(masked))
    loss, grad = [], []
    for a in ADV:
        unclipped, clipped = s * a, min(max(s, low), high) * a
        loss.append(-min(unclipped, clipped))
        grad.append(-s * a if unclipped <= clipped else 0.0)
    return loss, grad


@pytest.mark.parametrize("low,high", [(0.8, 1.2), (0.95, 1.01)])
def test_gspo_clips_the_sequence_ratio_each_token_keeping_its_own_gradient(
    low: float, high: float
) -> None:
    config = (
        {}
        if (low, high) == (0.8, 1.2)
        else {"clip_low_threshold": low, "clip_high_threshold": high}
    )
    loss, grad = _run("gspo", config, sequence_mask=torch.tensor(MASK))
    ref_loss, ref_grad = _gspo_reference(low, high)
    assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-7)  # float32
    assert grad == pytest.approx(ref_grad, rel=1e-6, abs=1e-7)


def test_gspo_ignores_unmasked_tokens_in_the_ratio() -> None:
    """A prompt position (mask 0) with a wild log-ratio leaves the sequence ratio alone."""
    base, _ = _run("gspo", None, sequence_mask=torch.tensor(MASK))
    logp = torch.tensor([5.0, *LOGP[1:]], requires_grad=True)
    inputs = TokenLossInputs(
        logp, advantages=torch.tensor(ADV), sampling_logprobs=torch.tensor(OLD),
        sequence_mask=torch.tensor(MASK),
    )  # fmt: skip
    assert build_token_loss("gspo")(inputs).tolist()[1:] == pytest.approx(base[1:])


def _stable(config: dict | None, mask: list[float]) -> tuple[list[float], list[float]]:
    logp = torch.tensor(LOGP, requires_grad=True)
    inputs = TokenLossInputs(
        logp,
        advantages=torch.tensor(ADV),
        sampling_logprobs=torch.tensor(OLD),
        sampled_mask=torch.tensor(mask),
    )
    loss = build_token_loss("stable_reinforce", config)(inputs)
    loss.sum().backward()
    return loss.tolist(), logp.grad.tolist()


def test_stable_reinforce_is_importance_sampling_on_the_sampled_targets() -> None:
    mask = [1.0, 1.0, 0.0, 1.0]  # the third target was not sampled (a prompt token)
    loss, grad = _stable(None, mask)
    is_loss, is_grad = _run("importance_sampling")
    assert loss == pytest.approx([v * m for v, m in zip(is_loss, mask, strict=True)], rel=1e-6)
    assert grad == pytest.approx([g * m for g, m in zip(is_grad, mask, strict=True)], rel=1e-6)


def test_stable_reinforce_kl_coeff_adds_the_k3_estimate() -> None:
    mask = [1.0, 1.0, 1.0, 0.0]
    loss, grad = _stable({"kl_coeff": 0.3}, mask)
    for i in range(4):
        r = _ratio(i)
        k3 = r - 1 - math.log(r)
        assert loss[i] == pytest.approx(mask[i] * (-r * ADV[i] + 0.3 * k3), rel=1e-5)
        # d/dlogp: -r A + 0.3 (r - 1)
        assert grad[i] == pytest.approx(mask[i] * (-r * ADV[i] + 0.3 * (r - 1)), rel=1e-5)
    with pytest.raises(ValueError, match="kl_coeff"):
        build_token_loss("stable_reinforce", {"kl_coeff": -1.0})
