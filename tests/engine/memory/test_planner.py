"""The live-bytes tracker agrees with real CPU tensors, and the planner (the engine's own
step under fake tensors) reports sizes that follow from the shapes."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.memory.fake_model import keep_index_values
from loraplex_engine.memory.planner import Workload, load_config, plan
from loraplex_engine.memory.tracker import LiveBytes, storage_bytes
from loraplex_engine.settings.values import parse_bytes
from loraplex_engine.train.algorithms import ClippedRatioLoss
from loraplex_engine.train.chunked_logprobs import HiddenStatesForward
from loraplex_engine.train.rows import TrainRow
from loraplex_engine.train.step import fused_backward
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoModelForCausalLM

from tests.support.lora_helpers import CONFIGS

CPU = torch.device("cpu")
SMALL = dict(prompts_per_tenant=2, completions_per_prompt=2, prompt_tokens=6,
             completion_tokens=10, micro_batch_tokens=40)  # fmt: skip


def test_tracker_counts_real_allocations_and_frees() -> None:
    with LiveBytes() as tracker:
        a = torch.empty(1000)
        b = a[10:]  # a view: no new storage
        c = torch.ones(3, 5, dtype=torch.bfloat16)
        assert tracker.live == 4000 + 30
        del a
        assert tracker.live == 4030  # b keeps the storage alive
        del b
        assert tracker.live == 30
        del c
    assert tracker.live == 0 and tracker.peaks["default"].bytes == 4030


def test_tracker_sees_the_real_model_bytes(tiny_model_dir) -> None:
    """A real model built as the planner builds one (from its config), with adapters."""
    with LiveBytes() as tracker:
        model = MultiLoRAModel(AutoModelForCausalLM.from_config(load_config(tiny_model_dir)), 4, 8)
        for i, (name, cfg) in enumerate(CONFIGS.items()):
            model.add_adapter(name, cfg, seed=i)
    tensors = [*model.parameters(), *model.buffers()]
    real = sum(t.numel() * t.element_size() for t in tensors)
    assert real > 0 and tracker.live >= real  # plus the small tensors still referenced
    assert tracker.live - real < 0.02 * real
    assert storage_bytes(tensors) == real


def _rows(model) -> list[TrainRow]:
    rows = []
    for i, name in enumerate(CONFIGS):
        prompt = [5 + i, 6, 7, 8]
        for k in range(3):
            done = [9 + k, 10, 11, 12, 13][: 2 + k]
            rows.append(TrainRow(name, model.slot_of(name), prompt, done, [-1.0] * len(done),
                                 0.5 - k, 1.0, 0))  # fmt: skip
    return rows


def _step_peak(config, fake: bool) -> tuple[int, int]:
    """(peak bytes, gradient bytes) of one fused step, on real tensors or fake ones."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext()
    with keep_index_values(), fake_mode, LiveBytes(fake_scalars=True) as tracker:
        torch.manual_seed(0)
        model = MultiLoRAModel(AutoModelForCausalLM.from_config(config).eval(), 4, 8)
        for i, (name, cfg) in enumerate(CONFIGS.items()):
            model.add_adapter(name, cfg, seed=i)
        updates = {n: ClippedRatioLoss() for n in CONFIGS}
        with tracker.in_phase("step") as peak:
            fused_backward(HiddenStatesForward(model, CPU), _rows(model), updates, 0, 4096)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return peak.bytes, storage_bytes(grads)


def test_fake_tensors_account_like_real_ones(tiny_model_dir) -> None:
    """The planner's premise: the same step on fake tensors counts the same bytes."""
    config = load_config(tiny_model_dir)
    real_peak, real_grads = _step_peak(config, fake=False)
    fake_peak, fake_grads = _step_peak(config, fake=True)
    assert real_grads > 0 and fake_grads == real_grads
    # Equal up to a few scalar tensors (0-d temporaries the fake mode makes differently).
    assert abs(fake_peak - real_peak) <= 1e-4 * real_peak


@pytest.mark.parametrize("checkpointing", [False, True])
def test_plan_of_the_tiny_model_follows_from_its_shapes(tiny_model_dir, checkpointing) -> None:
    config = load_config(tiny_model_dir)
    work = Workload(adapters=3, rank=4, checkpointing=checkpointing, **SMALL)
    row = plan(config, work, 2**30, name="tiny")
    peak, detail = row["peak_bytes"], row["detail"]
    assert detail["plan_seconds"] < 60  # a few seconds on a quiet CPU

    # bf16 weights of the base; fp32 LoRA slots (adapters + slot 0), grads, 2 Adam moments.
    hidden, layers = config.hidden_size, config.num_hidden_layers
    kv_heads = config.num_key_value_heads
    head_dim = hidden // config.num_attention_heads
    real = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # real tensors
    tensors = [*real.parameters(), *real.buffers()]
    assert peak["base"] == sum(t.numel() * t.element_size() for t in tensors)
    inter = config.intermediate_size
    kv = kv_heads * head_dim
    shapes = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden)]  # q k v o
    shapes += [(hidden, inter), (hidden, inter), (inter, hidden)]  # gate up down
    per_layer = sum(i + o for i, o in shapes)
    head = 0 if config.tie_word_embeddings else hidden + config.vocab_size  # the engine's
    slots = (3 + 1) * work.rank * (per_layer * layers + head) * 4
    assert detail["adapter_parts"] == {"slots": slots, "grads": slots, "adam": 2 * slots}
    assert peak["adapters"] == 4 * slots

    # Every tenant's rows fit the default rollout budget: one micro-batch, one KV cache of
    # rows x (prompt + completion - 1) tokens.
    rows = 3 * work.rows_per_tenant
    assert (detail["rollout_micro_batches"], detail["rollout_micro_batch_rows"]) == (1, rows)
    per_token = layers * 2 * kv_heads * head_dim * 2
    assert peak["kv_cache"] == rows * (work.prompt_tokens + work.completion_tokens - 1) * per_token
    assert peak["activations"] > 0 and peak["logits"] >= 0
    assert peak["total"] >= detail["train_total"] >= peak["base"] + peak["adapters"]
    ratio = row["train_flops"] / row["floor_flops"]
    assert (1.2 < ratio < 2.0) if checkpointing else (0.8 < ratio < 1.15)


def test_the_planned_kv_cache_is_bounded_by_the_rollout_budget(tiny_model_dir) -> None:
    """One tenant's rows cost 4 x 16 = 64 KV tokens; a budget of 130 holds two tenants."""
    config = load_config(tiny_model_dir)
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    kv = {}
    for adapters, budget in ((2, 130), (6, 130), (6, 10**9)):
        work = Workload(adapters=adapters, rank=4, rollout_kv_tokens=budget, **SMALL)
        row = plan(config, work, 2**30)
        kv[adapters, budget] = row["peak_bytes"]["kv_cache"], row["detail"]
    assert kv[2, 130][0] == kv[6, 130][0] <= 130 * per_token
    assert kv[6, 130][1]["rollout_micro_batches"] == 3
    assert kv[6, 10**9][0] == 3 * kv[6, 130][0]  # one batch of every tenant's rows
    assert kv[6, 10**9][1]["rollout_micro_batches"] == 1


def test_plan_cli_prints_json(tiny_model_dir) -> None:
    cmd = [sys.executable, "-m", "loraplex_engine.cli", "plan", "--config", str(tiny_model_dir),
           "--adapters", "2", "--rank", "4", "--prompts-per-tenant", "1",
           "--completions-per-prompt", "2", "--prompt-tokens", "4", "--completion-tokens", "4",
           "--device-memory", "1GiB", "--quiet"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    row = json.loads(out.stdout)
    assert row["adapters"] == 2 and row["detail"]["device_bytes"] == 2**30
    assert row["world_size"] == 1 and row["shard_base"] is False
    assert set(row["peak_bytes"]) == {"total", "base", "adapters", "activations", "logits",
                                      "kv_cache", "all_gather"}  # fmt: skip
    bad = subprocess.run([*cmd[:-3], "--device-memory", "80XB"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "--device-memory" in bad.stderr
    bad = subprocess.run([*cmd, "--cut-layers", "3"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--cut-layers" in bad.stderr
    bad = subprocess.run([*cmd, "--shard-base"], capture_output=True, text=True)
    assert bad.returncode == 2 and "shard_base needs world_size" in bad.stderr


def test_parse_bytes() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("1024") == 1024
    with pytest.raises(ValueError, match="device-memory"):
        parse_bytes("lots")


def test_checkpointing_lowers_the_planned_activations(tiny_model_dir) -> None:
    """Checkpointed layers keep only their inputs; the recompute costs FLOPs instead."""
    config = load_config(tiny_model_dir)
    plain, ckpt = (
        plan(config, Workload(adapters=2, rank=4, checkpointing=c, **SMALL), 2**30)
        for c in (False, True)
    )
    assert ckpt["peak_bytes"]["activations"] < 0.8 * plain["peak_bytes"]["activations"]
    assert ckpt["train_flops"] > 1.2 * plain["train_flops"]
    assert ckpt["floor_flops"] == plain["floor_flops"]
