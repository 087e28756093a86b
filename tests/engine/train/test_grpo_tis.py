"""Truncated importance sampling (TIS) in the GRPO loss: the weight, where it applies,
and that it changes nothing when the sampler is the trainer."""

import math

import pytest
import torch
from loraplex_engine.train.algorithms import ClippedRatioLoss, LossInputs, grpo_loss, tis_weights

LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADV = torch.tensor([1.5, -0.5])


def test_weight_is_the_truncated_ratio_of_trainer_to_sampler() -> None:
    old = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    behaviour = old - torch.tensor([math.log(1.5), math.log(5.0), -math.log(2.0), 0.0])
    w = tis_weights(old, behaviour, cap=2.0)
    # 1.5 kept, 5 truncated to the cap, 0.5 kept (no lower truncation), equal -> 1.
    assert torch.allclose(w, torch.tensor([1.5, 2.0, 0.5, 1.0]))


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_tis_is_plain_grpo_when_the_sampler_is_the_trainer(kl_coef: float) -> None:
    old = LOGP - 0.05  # off the trust region's centre, so the clip matters too
    ref = LOGP + 0.2
    results = []
    for tis in (None, 2.0):
        logp = LOGP.clone().requires_grad_(True)
        out = grpo_loss(
            logp, old, ref, ADV, MASK, 0.2, kl_coef, behaviour_logprobs=old, tis_cap=tis
        )
        out.seq_loss.sum().backward()
        results.append((out.seq_loss.detach(), logp.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize(
    ("gap", "weight"),
    [(math.log(1.5), 1.5), (math.log(5.0), 3.0), (-math.log(4.0), 0.25)],
)
def test_gradient_scales_by_the_weight_up_to_the_cap(gap: float, weight: float) -> None:
    old = torch.tensor([[-2.0]])
    logp = old.clone().requires_grad_(True)  # on-policy for the trainer: ratio 1
    behaviour = old - gap  # the sampler saw the token exp(gap) times less likely
    out = grpo_loss(
        logp, old, None, torch.tensor([2.0]), torch.ones(1, 1), 0.2, 0.0, behaviour, 3.0
    )
    out.seq_loss.sum().backward()
    # d(-A·w·exp(logp - old))/dlogp at ratio 1 = -A·w
    assert logp.grad.item() == pytest.approx(-2.0 * weight)
    assert out.seq_loss.item() == pytest.approx(-2.0 * weight)
    assert out.tis_mean is not None and out.tis_mean.item() == pytest.approx(weight)


def test_weight_carries_no_gradient_and_leaves_the_kl_term_alone() -> None:
    old = torch.tensor([[-2.0, -1.0]])
    behaviour = (old - 1.0).requires_grad_(True)
    logp = old.clone().requires_grad_(True)
    ref = old + 0.3
    # Zero advantage: only the KL penalty is left, which TIS must not reweight.
    kw = {"clip": 0.2, "kl_coef": 0.5}
    plain = grpo_loss(logp, old, ref, torch.zeros(1), torch.ones(1, 2), **kw)
    tis = grpo_loss(
        logp, old, ref, torch.zeros(1), torch.ones(1, 2), **kw,
        behaviour_logprobs=behaviour, tis_cap=2.0,
    )  # fmt: skip
    assert torch.equal(plain.seq_loss, tis.seq_loss)
    tis.seq_loss.sum().backward()
    assert behaviour.grad is None


def test_masked_tokens_do_not_count_in_the_weight_mean() -> None:
    old = torch.zeros(1, 2)
    behaviour = torch.tensor([[-math.log(1.5), -100.0]])  # the masked token: huge ratio
    out = grpo_loss(old, old, None, torch.ones(1), torch.tensor([[1, 0]]), 0.2, 0.0, behaviour, 2.0)
    assert out.tis_mean.item() == pytest.approx(1.5)
    assert out.seq_loss.item() == pytest.approx(-1.5)


def test_tis_needs_behaviour_logprobs_and_a_cap_of_at_least_one() -> None:
    with pytest.raises(ValueError, match="behaviour"):
        grpo_loss(LOGP, LOGP, None, ADV, MASK, tis_cap=2.0)
    with pytest.raises(ValueError, match="at least 1"):
        tis_weights(LOGP, LOGP, cap=0.5)


def test_the_grpo_loss_passes_tis_through() -> None:
    old = torch.tensor([[-1.0]])
    loss = ClippedRatioLoss(tis_cap=2.0)
    out = loss(
        LossInputs(old, old, torch.tensor([1.0]), torch.ones(1, 1), None, old - math.log(1.8))
    )
    assert out.seq_loss.item() == pytest.approx(-1.8)
