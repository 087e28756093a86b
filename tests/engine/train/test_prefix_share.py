"""Shared prompt prefixes in training: each prompt group's prompt runs once per micro-batch,
its KV cache is expanded to the group's rows, and the adapters get the gradients of the
unshared path (every row run as prompt + completion) up to float rounding."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from loraplex_engine.train.algorithms import ClippedRatioLoss
from loraplex_engine.train.rows import TrainRow, pack_micro_batches_shared, prefix_groups
from loraplex_engine.train.shared_prefix import prefix_sharing_unsupported, shared_prefix_forward
from loraplex_engine.train.step import fused_backward, plan_micro_batches

from tests.support.engine_builders import engine, spec
from tests.support.lora_helpers import CONFIGS, multi_model, rel_err

PAD = 0
KL = {"a": 0.0, "b": 0.1, "c": 0.0}  # one tenant with a KL term (slot 0 reference)


def _rows(model, seed: int = 0) -> list[TrainRow]:
    """Three tenants (ranks 2, 8, 4), groups of 1-5 rows, prompts of 2-11 tokens,
    completions of 1-7 tokens, per-group temperatures; plus a one-token prompt (cannot
    share) and a row without a group."""
    rng = random.Random(seed)
    rows = []
    for name in CONFIGS:
        slot = model.slot_of(name)
        for group, size in enumerate((5, 4, 1, 3)):
            prompt = [rng.randrange(4, 200) for _ in range(rng.randint(2, 11))]
            for _ in range(size):
                done = [rng.randrange(4, 200) for _ in range(rng.randint(1, 7))]
                old = [rng.uniform(-6.0, -4.0) for _ in done]
                temp = 0.6 + 0.2 * group
                rows.append(
                    TrainRow(name, slot, prompt, done, old, rng.uniform(-1, 1), temp, group)
                )
    rows.append(TrainRow("a", model.slot_of("a"), [7], [9, 11], [-5.0, -5.0], 0.5, 1.0, 9))
    rows.append(TrainRow("c", model.slot_of("c"), [5, 6, 7], [8], [-5.0], -0.5, 1.0, None))
    return rows


def _grads(model_dir: Path, budget: int, shared: bool):
    model = multi_model(model_dir)
    model.train()
    updates = {n: ClippedRatioLoss(kl_coef=KL[n]) for n in CONFIGS}

    def forward(ids, attn, slots):
        return model(input_ids=ids, attention_mask=attn, slot_ids=slots).logits.float()

    share = shared_prefix_forward(model, torch.device("cpu")) if shared else None
    stats = fused_backward(forward, _rows(model), updates, PAD, budget, share)
    grads = {n: model.adapter_views(n, lambda p: p.grad) for n in CONFIGS}
    return grads, stats


# 4096: every group in one micro-batch. 24: groups split across micro-batches (each piece
# recomputes its prefix), and pieces of single rows fall back to the unshared forward.
@pytest.mark.parametrize("budget", [4096, 24])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shared_prefix_gradients_equal_unshared(
    arch, budget, tiny_model_dir, tiny_qwen2_dir
) -> None:
    model_dir = tiny_model_dir if arch == "llama" else tiny_qwen2_dir
    ref, ref_stats = _grads(model_dir, budget, shared=False)
    got, stats = _grads(model_dir, budget, shared=True)
    assert ref_stats.shared_micro_batches == 0 and stats.shared_micro_batches > 0
    if budget == 24:
        assert stats.shared_micro_batches < stats.micro_batches  # some fell back
    assert stats.computed_tokens < ref_stats.computed_tokens
    assert stats.tokens == ref_stats.tokens  # logical tokens: prompt + completion per row
    for name in CONFIGS:
        assert stats.loss[name] == pytest.approx(ref_stats.loss[name], rel=1e-5, abs=1e-7)
        assert got[name].keys() == ref[name].keys()
        for key in ref[name]:
            assert ref[name][key].norm() > 0, (name, key)
            assert rel_err(got[name][key], ref[name][key]) < 1e-5, (arch, name, key)


def test_split_budget_really_splits_a_group(tiny_model_dir) -> None:
    model = multi_model(tiny_model_dir)
    rows = _rows(model)
    where: dict[tuple, set[int]] = {}
    for b, (groups, _) in enumerate(plan_micro_batches(rows, 24, share_prefix=True)):
        for g in groups:
            for i in g:
                where.setdefault(rows[i].prefix_key, set()).add(b)
    assert any(len(batches) > 1 for key, batches in where.items() if key is not None)


def _row(exp: str, slot: int, prompt: int, completion: int, group: int | None) -> TrainRow:
    ids = list(range(4, 4 + prompt))
    return TrainRow(exp, slot, ids, [9] * completion, [-1.0] * completion, 0.0, 1.0, group)


def test_packing_counts_each_prefix_once_and_keeps_groups_together() -> None:
    # Two tenants, 2 groups each of 8 rows: 20-token prompts, 8-token completions.
    rows = [
        _row(exp, slot, 20, 8, g)
        for exp, slot in (("x", 1), ("y", 2))
        for g in (0, 1)
        for _ in range(8)
    ]
    one_group = 19 + 8 * 8  # prefix once + 8 completions (the prompt's last token rides along)
    batches = pack_micro_batches_shared(rows, 2 * one_group)
    assert len(batches) == 2
    for groups in batches:
        assert len(groups) == 2 and all(len(g) == 8 for g in groups)
        assert all(len({rows[i].prefix_key for i in g}) == 1 for g in groups)
    # Unshared, the same rows need 28 tokens each: 4x as many micro-batches at this budget.
    assert len(plan_micro_batches(rows, 2 * one_group, share_prefix=False)) > 2 * len(batches)


def test_a_group_over_the_budget_is_split_into_pieces_that_fit() -> None:
    rows = [_row("x", 1, 30, 10, 0) for _ in range(16)]
    budget = 29 + 5 * 10
    batches = pack_micro_batches_shared(rows, budget)
    assert sorted(i for b in batches for g in b for i in g) == list(range(16))
    for groups in batches:
        assert len(groups) == 1 and len(groups[0]) <= 5
    # A single row longer than the budget still trains (alone), as in the unshared packing.
    assert pack_micro_batches_shared([_row("x", 1, 30, 10, 0)], 8) == [[[0]]]


def test_rows_share_only_within_one_experiments_group() -> None:
    # Same tokens in two experiments (different slots): two prefixes, never one.
    rows = [_row("x", 1, 6, 3, 0), _row("y", 2, 6, 3, 0), _row("x", 1, 6, 3, 0)]
    assert prefix_groups(rows, range(3)) == [[0, 2], [1]]
    # No group, or a one-token prompt: the row shares with nothing.
    assert _row("x", 1, 6, 3, None).prefix_key is None
    assert _row("x", 1, 1, 3, 0).prefix_key is None
    # Rows claiming one group but holding different prompts are a caller bug.
    bad = [_row("x", 1, 6, 3, 0), _row("x", 1, 7, 3, 0)]
    with pytest.raises(ValueError, match="differ in prompt"):
        prefix_groups(bad, range(2))


def test_groups_of_one_train_unshared() -> None:
    """groupSize 1 (every prompt group one row): the plan is exactly the unshared one."""
    rows = [_row("x", 1, 5 + i, 3, i) for i in range(6)]
    shared = plan_micro_batches(rows, 4096, share_prefix=True)
    assert shared == plan_micro_batches(rows, 4096, share_prefix=False)
    assert not any(flag for _, flag in shared)


def test_unsupported_models_are_named(tiny_model_dir) -> None:
    model = multi_model(tiny_model_dir).base_model
    assert prefix_sharing_unsupported(model) is None
    model.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in prefix_sharing_unsupported(model)
    model.config._attn_implementation = "sdpa"
    model.config.layer_types = ["full_attention", "sliding_attention"]
    assert "sliding_attention" in prefix_sharing_unsupported(model)
    model.config.model_type = "gpt2"
    assert "gpt2" in prefix_sharing_unsupported(model)


def test_engine_updates_and_token_counts_equal_with_and_without_sharing(
    tiny_model_dir, tmp_path
) -> None:
    """Same seeds, three ticks, one tenant with a KL term: the same adapter weights up to
    float noise, the same trainTokens (logical), fewer tokens computed."""
    task = {"name": "target-token", "params": {"target": "yes"}}
    weights, tokens, computed = {}, {}, {}
    for share in (True, False):
        eng = engine(tiny_model_dir, tmp_path / str(share), share_prompt_prefix=share)
        assert eng.share_prompt_prefix is share
        eng.put_experiment("default.p", spec(task, seed=1, group=4), "default", "p")
        eng.put_experiment("default.q", spec(task, seed=2, group=4, kl=0.1), "default", "q")
        for _ in range(3):
            eng.tick()
        weights[share] = {i: eng.model.adapter_state_dict(i) for i in ("default.p", "default.q")}
        tokens[share] = {i: eng.get_experiment(i).train_tokens for i in ("default.p", "default.q")}
        computed[share] = eng.computed_train_tokens
    assert tokens[True] == tokens[False]
    assert computed[False] == sum(tokens[False].values())
    assert computed[True] < computed[False]
    for exp_id, state in weights[False].items():
        for key, value in state.items():
            other = weights[True][exp_id][key]
            torch.testing.assert_close(other, value, rtol=0, atol=1e-3)
            assert (other - value).abs().mean() < 1e-6, key
