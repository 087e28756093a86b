"""The engine's memory plan (memory/capacity_plan.py): static bytes exact against the tensors an
engine holds, the per-token costs against the planner (the engine's own step under fake
tensors, memory/planner.py), the budgets it derives, and what `serve` reports and refuses."""

from __future__ import annotations

import subprocess

import httpx
import pytest
import torch
from loraplex_engine.lora.layers import LoRAConfig
from loraplex_engine.lora.model import MultiLoRAModel, adaptable_module_names
from loraplex_engine.memory.capacity_plan import (
    MAX_MICRO_BATCH_TOKENS,
    ActivationCost,
    CapacityError,
    StaticBytes,
    derive_budgets,
    measure_activations,
    static_bytes,
)
from loraplex_engine.memory.planner import Workload, load_config, plan
from loraplex_engine.memory.tracker import storage_bytes
from loraplex_engine.rollout.vllm.config import kv_bytes_per_token
from loraplex_engine.train.optim import AdamWSettings, PerAdapterAdamW
from transformers import AutoModelForCausalLM

from tests.support.server_process import EngineServer, engine_command

GiB = 2**30
# The planner's small workload (test_planner.py): rows of 6 + 10 tokens, two a micro-batch.
SMALL = dict(prompts_per_tenant=2, completions_per_prompt=2, prompt_tokens=6,
             completion_tokens=10, micro_batch_tokens=32)  # fmt: skip


def _engine_model(config, adapters: int, rank: int, dtype=torch.float32) -> MultiLoRAModel:
    """The model as the engine wraps it: every adaptable linear (lm_head included when
    untied), fp32 masters."""
    base = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return MultiLoRAModel(base, adapters, rank, adaptable_module_names(base), dtype=torch.float32)


def test_static_bytes_are_the_tensors_an_engine_holds_after_a_step(tiny_model_dir) -> None:
    model = _engine_model(load_config(tiny_model_dir), adapters=3, rank=8)
    optimizer = PerAdapterAdamW(model)
    names = tuple(sorted(model.target_modules))
    model.add_adapter("a", LoRAConfig(4, 8.0, target_modules=("q_proj",)))  # rank below max
    optimizer.add_adapter("a", AdamWSettings(lr=1e-3))
    for p in optimizer.params:  # a step's gradients: whole stacks, every slot
        p.grad = torch.zeros_like(p)
    s = static_bytes(model)
    assert "lm_head" in names and s.slots == 4
    lora = [t for layer in model.lora_layers.values()
            for t in (*layer.parameters(recurse=False), *layer.buffers(recurse=False))]  # fmt: skip
    grads = [p.grad for p in optimizer.params]
    moments = [*optimizer.exp_avg.values(), *optimizer.exp_avg_sq.values()]
    assert s.slot * s.slots == storage_bytes([*lora, *grads, *moments])
    everything = storage_bytes([*model.parameters(), *model.buffers()])
    assert s.base == everything - storage_bytes(lora)
    # Every slot costs the same, at max rank on every wrapped linear, whatever its rank.
    per_layer = sum(8 * (m.in_features + m.out_features) for m in model.lora_layers.values())
    assert s.slot == 4 * 4 * per_layer + 2 * 4 * len(model.lora_layers)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_plan_agrees_with_the_planner(tiny_model_dir, checkpointing) -> None:
    """The planner runs the whole step (every micro-batch, the optimiser, the rollout)
    under fake tensors; the plan's figures predict its peaks."""
    config = load_config(tiny_model_dir)
    targets = tuple(adaptable_module_names(AutoModelForCausalLM.from_config(config)))
    work = Workload(adapters=3, rank=4, targets=targets, checkpointing=checkpointing, **SMALL)
    row = plan(config, work, GiB, name="tiny")
    detail = row["detail"]

    model = _engine_model(config, 3, 4, torch.bfloat16)
    s = static_bytes(model)
    buffers = 2 * 4 * 4 * len(model.lora_layers)  # fp32 scale and dropout of 4 slots
    assert row["peak_bytes"]["base"] == s.base
    assert row["peak_bytes"]["adapters"] == s.slot * s.slots - buffers  # exact
    kv = kv_bytes_per_token(config, 2)
    assert detail["kv_bytes_per_token"] == kv  # one decode step's growth, per row

    act = measure_activations(config, torch.bfloat16, targets, 4, work.row_tokens,
                              work.prompt_tokens, checkpointing)  # fmt: skip
    # A micro-batch holds two rows of one tenant (4 rows per tenant, budget 32 tokens).
    predicted = s.total - buffers + act.bytes(2 * work.row_tokens, 1)
    assert abs(predicted - detail["train_peak"]) <= 0.005 * detail["train_peak"]  # seen 0.04%
    assert act.per_token > 0 and act.per_slot > 0


def test_activations_extend_linearly_with_depth(tiny_model_dir) -> None:
    """Measured on the model cut to 2 and 3 layers, extended to its depth: the same as
    measured on every layer (here a 4-layer model: cut 2 and 3, extended to 4)."""
    config = load_config(tiny_model_dir)
    config.num_hidden_layers = 4
    from loraplex_engine.memory import capacity_plan

    targets = ["q_proj", "v_proj", "lm_head"]
    cut = measure_activations(config, torch.float32, targets, 8, 64, 16, False)
    full = capacity_plan._peaks(config, torch.float32, targets, 8, 64, 16, False)
    one, two, mixed = full
    assert cut.per_slot == mixed - two
    assert abs(cut.bytes(64, 1) - one) <= 0.01 * one
    assert abs(cut.bytes(128, 1) - two) <= 0.01 * two


# --- derive_budgets (pure) ------------------------------------------------------------

STATIC = StaticBytes(base=8 * GiB, slot=GiB, slots=9)  # 8 adapters + slot 0: 17 GiB
ACTS = ActivationCost(fixed=GiB, per_token=2**20, per_slot=2**28)  # 1 MiB a token


def _derive(device: int | None, **kw):  # type: ignore[no-untyped-def]
    args = dict(device_bytes=device, static=STATIC, activations=ACTS, kv_per_token=2**17,
                longest_row=2048, headroom=0.1)  # fmt: skip
    return derive_budgets(**{**args, **kw})


def test_budgets_fill_what_the_static_bytes_leave() -> None:
    b = _derive(40 * GiB)
    free = int(40 * GiB * 0.9) - 17 * GiB
    assert b.free_bytes == free
    # Activations of a micro-batch with all 8 adapters in it fill the rest.
    assert b.micro_batch_tokens == (free - GiB - 8 * 2**28) // 2**20
    assert ACTS.bytes(b.micro_batch_tokens, 8) <= free < ACTS.bytes(b.micro_batch_tokens + 1, 8)
    assert b.rollout_kv_tokens == free // 2**17
    assert b.derived == ("microBatchTokens", "rolloutKvTokens")


def test_given_budgets_are_kept_and_a_derived_one_is_bounded() -> None:
    b = _derive(40 * GiB, micro_batch_tokens=1000, rollout_kv_tokens=5)
    assert (b.micro_batch_tokens, b.rollout_kv_tokens, b.derived) == (1000, 5, ())
    huge = _derive(10_000 * GiB)
    assert huge.micro_batch_tokens == MAX_MICRO_BATCH_TOKENS
    assert _derive(40 * GiB, plan_rollout=False).rollout_kv_tokens is None  # vLLM's own


def test_without_device_memory_the_defaults_apply() -> None:
    b = _derive(None)
    assert (b.micro_batch_tokens, b.rollout_kv_tokens, b.free_bytes, b.derived) == (
        4096, None, None, ()
    )  # fmt: skip


def test_too_small_a_device_is_refused_saying_what_fits() -> None:
    # 24 GiB x 0.9 = 21.6: base 8 + 9 slots + a 2,048-token micro-batch (1 + 2 + 2) = 22.
    with pytest.raises(CapacityError, match="--max-adapters 7 fits"):
        _derive(24 * GiB)
    # Not even the base, two slots (slot 0 and one adapter) and one micro-batch.
    with pytest.raises(CapacityError, match="one adapter slot") as e:
        _derive(12 * GiB)
    assert "longest row (2048 tokens" in str(e.value)
    with pytest.raises(ValueError, match="headroom"):
        _derive(40 * GiB, headroom=1.0)


# --- serve: /v1/capacity reports the plan ---------------------------------------------


def test_serve_reports_its_plan_and_derives_from_device_memory(tiny_model_dir, tmp_path) -> None:
    args = ["--device-memory", "2GiB", "--max-prompt-tokens", "64"]
    with EngineServer(tiny_model_dir, tmp_path / "ckpt", extra_args=args) as srv:
        cap = httpx.get(f"{srv.url}/v1/capacity", headers=srv.headers).json()
    p = cap["plan"]
    assert p["deviceBytes"] == 2 * GiB and p["slots"] == cap["maxAdapters"] + 1
    assert p["derived"] == ["microBatchTokens", "rolloutKvTokens"]
    assert p["staticBytes"] == p["baseBytes"] + p["slots"] * p["slotBytes"]
    free = int(2 * GiB * (1 - p["headroom"])) - p["staticBytes"]
    need = p["activationFixedBytes"] + 4 * p["activationBytesPerAdapter"]
    assert need + p["activationBytesPerToken"] * p["microBatchTokens"] <= free
    assert p["rolloutKvTokens"] == free // p["kvBytesPerToken"]


def test_serve_without_device_memory_on_cpu_keeps_the_defaults(tiny_model_dir, tmp_path) -> None:
    with EngineServer(tiny_model_dir, tmp_path / "ckpt") as srv:
        p = httpx.get(f"{srv.url}/v1/capacity", headers=srv.headers).json()["plan"]
    assert p["deviceBytes"] is None and p["deviceTotalBytes"] > 0
    assert (p["microBatchTokens"], p["rolloutKvTokens"], p["derived"]) == (4096, 65536, [])
    assert p["activationBytesPerToken"] is None and p["slotBytes"] > 0


def test_serve_refuses_a_device_too_small_in_one_line(tiny_model_dir, tmp_path) -> None:
    cmd = [*engine_command(), "serve", "--model", str(tiny_model_dir), "--insecure-no-auth",
           "--port", "0", "--checkpoint-root", str(tmp_path),
           "--device-memory", "1MiB"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "one adapter slot" in errors[0], out.stderr[-2000:]
