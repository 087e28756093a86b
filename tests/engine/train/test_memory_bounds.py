"""Gradient checkpointing keeps each row's adapter through the recompute, and chunked
log-probs equal the full-vocabulary ones; both give the gradients of the plain path."""

from __future__ import annotations

import random

import pytest
import torch
from loraplex_engine.lora.gradient_checkpointing import gradient_checkpointing
from loraplex_engine.train.algorithms import ClippedRatioLoss, token_logprobs
from loraplex_engine.train.chunked_logprobs import HiddenStatesForward, chunked_token_logprobs
from loraplex_engine.train.rows import TrainRow
from loraplex_engine.train.step import fused_backward

from tests.support.lora_helpers import CONFIGS, multi_model

CPU = torch.device("cpu")
KL = {"a": 0.0, "b": 0.1, "c": 0.0}  # one tenant with a KL term (slot 0 reference)


def _rows(model, seed: int = 0) -> list[TrainRow]:
    """Three tenants, GRPO-like groups, prompts and completions of varied lengths."""
    rng = random.Random(seed)
    rows = []
    for name in CONFIGS:
        for group in range(3):
            prompt = [rng.randrange(4, 200) for _ in range(rng.randint(2, 9))]
            for _ in range(3):
                done = [rng.randrange(4, 200) for _ in range(rng.randint(1, 7))]
                old = [rng.uniform(-6.0, -4.0) for _ in done]
                rows.append(
                    TrainRow(name, model.slot_of(name), prompt, done, old, rng.uniform(-1, 1),
                             0.7 + 0.2 * group, group)
                )  # fmt: skip
    return rows


def _grads(model_dir, make_forward, budget: int = 64, checkpointing: bool = False):
    model = multi_model(model_dir)
    updates = {n: ClippedRatioLoss(kl_coef=KL[n]) for n in CONFIGS}
    fused_backward(make_forward(model), _rows(model), updates, 0, budget,
                   gradient_checkpointing=checkpointing)  # fmt: skip
    return {n: model.adapter_views(n, lambda p: p.grad) for n in CONFIGS}


def _logits_forward(model):
    def forward(ids, attn, slots):
        return model(input_ids=ids, attention_mask=attn, slot_ids=slots).logits.float()

    return forward


def _assert_same(got, ref, tol: float) -> None:
    for name in ref:
        for key, g in ref[name].items():
            assert g.abs().sum() > 0, (name, key)
            assert torch.allclose(got[name][key], g, atol=tol, rtol=0), (name, key)


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_chunked_logprobs_equal_full_and_their_gradients(tiny_model_dir, chunk) -> None:
    model = multi_model(tiny_model_dir)
    fwd = HiddenStatesForward(model, CPU, chunk_tokens=chunk)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 200, (4, 9), generator=g)
    attn = torch.ones_like(ids)
    slots = torch.tensor([1, 3, 0, 2])
    temp = torch.tensor([0.7, 1.0, 1.3, 0.9])
    scored = torch.tensor([0, 1, 5, 9, 10, 20, 33, 35])  # flat positions in [4, 9]
    mask = torch.zeros(4 * 9)
    mask[scored] = 1

    full = token_logprobs(_logits_forward(model)(ids, attn, slots) / temp[:, None, None], ids)
    ref = (full * mask.view(4, 9)).sum()
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()

    got = chunked_token_logprobs(fwd(ids, attn, slots), fwd.head, ids, 1 / temp, scored, chunk)
    assert torch.allclose(got.flatten()[scored], full.flatten()[scored], atol=1e-6, rtol=0)
    assert got.flatten()[mask == 0].abs().sum() == 0
    got.sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    # float32 sums in another order: equal to ~1e-6 of gradients of order 1 (1.05e-6
    # measured at chunk 1), hence the relative term.
    assert all(
        torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(grads, ref_grads, strict=True)
    )


def test_chunked_logprobs_with_a_trainable_head_recompute_per_chunk(tiny_model_dir) -> None:
    """A head with gradient (e.g. an adapter on lm_head) takes the checkpointed path."""
    model = multi_model(tiny_model_dir)
    head = model.base_model.get_output_embeddings().requires_grad_(True)
    hidden = torch.randn(2, 5, head.in_features, requires_grad=True)
    targets = torch.randint(0, head.out_features, (2, 5))
    scored = torch.arange(10)
    inv_temp = torch.tensor([1.0, 2.0])
    got = chunked_token_logprobs(hidden, head, targets, inv_temp, scored, chunk_tokens=3)
    full = token_logprobs(head(hidden) * inv_temp[:, None, None], targets)
    assert torch.allclose(got, full, atol=1e-6)
    got.sum().backward()
    ref_h, ref_w = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    full.sum().backward()
    assert torch.allclose(hidden.grad, ref_h, atol=1e-6)
    assert torch.allclose(head.weight.grad, ref_w, atol=1e-6)


def test_fused_backward_chunked_equals_full_logits(tiny_model_dir) -> None:
    ref = _grads(tiny_model_dir, _logits_forward)
    got = _grads(tiny_model_dir, lambda m: HiddenStatesForward(m, CPU, chunk_tokens=5))
    _assert_same(got, ref, 1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_checkpointed_gradients_equal_plain_ones(arch, tiny_model_dir, tiny_qwen2_dir) -> None:
    """A mixed multi-adapter batch (three tenants, slot 0 for the KL reference)."""
    model_dir = tiny_model_dir if arch == "llama" else tiny_qwen2_dir

    def chunked(m):
        return HiddenStatesForward(m, CPU)

    ref = _grads(model_dir, chunked)
    got = _grads(model_dir, chunked, checkpointing=True)
    _assert_same(got, ref, 1e-6)


def test_checkpointing_recomputes_under_the_forwards_routing(tiny_model_dir) -> None:
    """The recompute really happens in backward (not a no-op), routed, and is switched off
    after the block; without the routing context the recompute would see no adapter."""
    model = multi_model(tiny_model_dir)
    fwd = HiddenStatesForward(model, CPU)
    ids = torch.randint(4, 200, (3, 6))
    calls: list[bool] = []
    layer = next(iter(model.lora_layers.values()))
    hook = layer.register_forward_pre_hook(lambda mod, _: calls.append(mod.router is not None))
    with gradient_checkpointing(model):
        hidden = fwd(ids, torch.ones_like(ids), torch.tensor([1, 2, 3]))
        assert calls == [True] and layer.router is None
        hidden.square().mean().backward()
    assert calls == [True, True]  # the recompute ran routed
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    hook.remove()


def test_checkpointing_needs_the_hidden_states_forward(tiny_model_dir) -> None:
    model = multi_model(tiny_model_dir)
    with pytest.raises(ValueError, match="HiddenStatesForward"):
        fused_backward(_logits_forward(model), _rows(model), {}, 0, 64,
                       gradient_checkpointing=True)  # fmt: skip
