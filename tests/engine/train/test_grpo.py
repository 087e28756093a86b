import math
from pathlib import Path

import pytest
import torch
from loraplex_engine.spec.experiment import AlgorithmSpec
from loraplex_engine.train.algorithms import (
    ALGORITHMS,
    ClippedRatioLoss,
    LossInputs,
    build_algorithm,
    group_advantages,
    grpo_loss,
    token_logprobs,
)


def test_group_advantages_hand_computed() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), group_size=2, eps=0.0)
    # group 1: mean 0.5, population std 0.5 → ±1; group 2: all equal → 0 (0/0 guarded).
    adv_eps = group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), group_size=2)
    assert torch.allclose(adv[:2], torch.tensor([1.0, -1.0]))
    assert torch.equal(adv_eps[2:], torch.zeros(2))


def test_identical_rewards_give_zero_advantage() -> None:
    adv = group_advantages(torch.full((8,), 0.7), group_size=4)
    assert torch.equal(adv, torch.zeros(8))


def test_advantages_without_std_normalisation() -> None:
    adv = group_advantages(torch.tensor([3.0, 1.0, 2.0]), group_size=3, normalize_std=False)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0]))


def test_group_size_must_divide() -> None:
    with pytest.raises(ValueError, match="multiple of group_size=3"):
        group_advantages(torch.zeros(4), group_size=3)


def test_on_policy_loss_is_minus_masked_mean_advantage() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = grpo_loss(logp, logp.detach(), None, torch.tensor([2.0, -1.0]), mask, clip=0.2)
    # ratio = 1 everywhere → token loss = -A; per-sequence masked mean.
    assert torch.allclose(out.seq_loss, torch.tensor([-2.0, 1.0]))
    out.seq_loss.sum().backward()
    # d(-A·exp(logp - old))/dlogp = -A, averaged over the row's 2 (resp. 1) tokens.
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert out.clip_fraction.item() == 0.0 and out.ratio_mean.item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("log_ratio", "adv", "clipped"),
    [
        (math.log(1.5), 1.0, True),  # above 1+ε with A>0: no further push up
        (math.log(0.5), -1.0, True),  # below 1-ε with A<0: no further push down
        (math.log(1.5), -1.0, False),  # above 1+ε with A<0: still corrected
        (math.log(0.5), 1.0, False),  # below 1-ε with A>0: still corrected
        (math.log(1.1), 1.0, False),  # inside the trust region
    ],
)
def test_clipping_zeroes_gradient_only_on_the_pessimistic_side(
    log_ratio: float, adv: float, clipped: bool
) -> None:
    old = torch.tensor([[-2.0]])
    logp = (old + log_ratio).clone().requires_grad_(True)
    out = grpo_loss(logp, old, None, torch.tensor([adv]), torch.ones(1, 1), clip=0.2)
    out.seq_loss.sum().backward()
    assert (logp.grad.abs().item() == 0.0) == clipped
    assert out.clip_fraction.item() == float(clipped)
    if not clipped:
        assert logp.grad.item() == pytest.approx(-adv * math.exp(log_ratio))


def test_kl_is_zero_when_policy_equals_reference() -> None:
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = grpo_loss(logp, logp.detach(), logp.detach(), torch.zeros(1), torch.ones(1, 2), 0.2, 1.0)
    assert out.kl.item() == 0.0 and out.seq_loss.item() == 0.0
    out.seq_loss.sum().backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))


def test_k3_kl_value_and_penalty() -> None:
    logp = torch.tensor([[-1.0]])
    ref = torch.tensor([[-2.0]])
    out = grpo_loss(logp, logp, ref, torch.zeros(1), torch.ones(1, 1), clip=0.2, kl_coef=0.5)
    k3 = math.exp(-1.0) - (-1.0) - 1.0
    assert out.kl.item() == pytest.approx(k3)
    assert out.seq_loss.item() == pytest.approx(0.5 * k3)


def test_masked_tokens_do_not_matter() -> None:
    logp = torch.tensor([[-1.0, -5.0]], requires_grad=True)
    mask = torch.tensor([[1, 0]])
    out = grpo_loss(logp, torch.tensor([[-1.0, 0.0]]), None, torch.ones(1), mask, clip=0.2)
    out.seq_loss.sum().backward()
    assert logp.grad[0, 1].item() == 0.0 and out.clip_fraction.item() == 0.0


def test_token_logprobs_matches_log_softmax() -> None:
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([[0, 4, 2], [1, 1, 3]])
    got = token_logprobs(logits, targets)
    assert torch.allclose(got[1, 2], torch.log_softmax(logits[1, 2], -1)[3])


def test_the_registry_builds_the_specs_settings_into_the_loss() -> None:
    """The spec's settings reach the loss whole, as typed fields (what a data-parallel
    worker receives): TIS only when the correction is on."""
    spec = AlgorithmSpec.model_validate(
        {"name": "grpo", "clip": 0.3, "klCoef": 0.1, "offPolicyCorrection": "tis", "tisCap": 3.0}
    )
    algo = build_algorithm(spec, 64)
    assert algo.name == "grpo" and ALGORITHMS["grpo"](spec, 64) == algo
    assert algo.loss == ClippedRatioLoss(clip=0.3, kl_coef=0.1, tis_cap=3.0)
    assert algo.loss.needs_reference and not ClippedRatioLoss().needs_reference
    plain = build_algorithm(AlgorithmSpec.model_validate({"tisCap": 3.0}), 64)
    assert plain.loss.tis_cap is None
    adv = algo.advantages(torch.tensor([1.0, 0.0]), 2)
    zeros = torch.zeros(2, 1)
    out = plain.loss(LossInputs(zeros, zeros, adv, torch.ones(2, 1)))
    assert out.seq_loss.shape == (2,) and out.tis_mean is None
    with pytest.raises(KeyError, match="unknown algorithm 'ppo'"):
        build_algorithm(AlgorithmSpec.model_construct(name="ppo"), 64)


def test_grpo_raises_reward_on_the_tiny_model(tiny_model_dir: Path) -> None:
    """End to end with plain PEFT: the tasks + GRPO maths actually learn (as the demo needs)."""
    import random

    from loraplex_engine.tasks import build_task
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    rng = random.Random(0)
    task = build_task("target-token", {"target": "yes"})
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.padding_side = "left"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    # lm_head must be a target on the tiny random model (see docs/architecture.md).
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "lm_head"])
    model = get_peft_model(base, cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02)
    curve = []
    for _ in range(25):
        prompts = [p for p in task.sample_prompts(4, rng) for _ in range(8)]
        enc = tok([p.text for p in prompts], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(
                **enc, do_sample=True, top_k=0, max_new_tokens=8, pad_token_id=tok.pad_token_id
            )
        plen = enc.input_ids.shape[1]
        gen = out[:, plen:]
        mask = torch.ones_like(gen)  # eos/pad handling is the loop's job; not needed here
        rewards = torch.tensor(task.score(prompts, tok.batch_decode(gen, skip_special_tokens=True)))
        attn = torch.cat([enc.attention_mask, mask], dim=1)
        logits = model(input_ids=out, attention_mask=attn).logits[:, plen - 1 : -1]
        logp = token_logprobs(logits, gen)
        adv = group_advantages(rewards, 8)
        loss = grpo_loss(logp, logp.detach(), None, adv, mask, clip=0.2).seq_loss.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve.append(rewards.mean().item())
    assert sum(curve[:5]) / 5 < 0.1
    assert sum(curve[-5:]) / 5 > 0.5
