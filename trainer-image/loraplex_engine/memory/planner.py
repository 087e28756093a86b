"""Memory and FLOP plan of a workload on a model, from its config alone (no weights).

The model is built with ``AutoModelForCausalLM.from_config`` under ``FakeTensorMode``
(tensors with shapes, dtypes and devices but no storage), wrapped with the engine's own
``MultiLoRAModel`` and ``PerAdapterAdamW``, and the engine's own code runs on it: the
training step (``training.fused_backward`` over ``TrainRow``s built as the engine builds
them, then the optimiser step) and the torch rollout's prefill (``_shared_prefill``) and
decode steps (its sampler included). ``memtrack.LiveBytes`` counts live storage bytes
throughout; ``FlopCounterMode`` counts the training step's FLOPs.

Micro-batches: the training peak is per micro-batch (gradient accumulation), so only the
first ``micro_batches`` of the step run (at least two, so the second runs with the
gradients already resident, as every later one does); FLOPs are scaled to the whole
step by tokens. The rollout decodes one micro-batch at a time under its KV-token budget
(``rollout_kv_tokens``, rollout/packing.py), so the plan runs the largest micro-batch the
engine's packing makes of every tenant's rows: ``decode_steps`` steps, the KV cache's
measured growth per step extended to the full completion length.

Depth: ``plan(cut_layers=(3, 4))`` measures the model cut to 3 and 4 decoder layers and
extends every number linearly to its depth (``extrapolate``): seconds instead of minutes,
and on Qwen3-4B's shapes the same bytes and FLOPs as all 36 layers. The cuts must be deep
enough that the moment which peaks at full depth already peaks in them: sharded, the
rollout's peak moves with depth (Llama-3.1-70B: exact from 20 and 40 layers, 2.1 GiB low
from 3 and 4; bench/memory_plan.py's ``CUTS``).

Ranks (``Workload.world_size``): the plan is rank 0's, with its share of the rows as the
engine splits them (train/row_split.py), for training and for the rollout (issue 17: each
rank decodes its own rows); with ``shard_base`` the frozen base is sharded by FSDP2's
own ``fully_shard`` on a fake process group (memory/plan_sharding.py), so the tracker sees the
rank's shards and FSDP's all-gather buffers (tagged ``all_gather``).

The FLOP floor of a training step over ``T`` tokens::

    floor = (4 P + 6 P_L) T + 3 F_a T

- ``P``: weights of every linear layer of the base, the output head included (an
  embedding lookup does no arithmetic). Forward: one multiply-add, 2 FLOPs, per weight
  per token. Backward: the frozen base needs the gradient of its inputs only (2 more),
  not of its weights: 4 P per token.
- ``P_L``: one adapter's LoRA weights (every token uses its own tenant's adapter).
  Forward 2, input gradient 2, weight gradient 2: 6 P_L per token.
- ``F_a``: attention's own matmuls per token in the forward, ``QK^T`` and ``AV``, each
  ``2 L d`` per query head per layer for a context of ``L`` keys:
  ``F_a = 4 n_layers n_heads head_dim L``, ``L`` the micro-batch's padded length (what a
  masked dense kernel computes, and what the FLOP counter counts); its backward costs
  two forwards: 3 F_a.

Gradient checkpointing recomputes each layer's forward in the backward (+2 P + 2 P_L +
F_a per token, about 1.5x the floor): it is reported, not folded into the floor.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from loraplex_engine.lora.layers import LoRAConfig
from loraplex_engine.lora.model import MultiLoRAModel, adaptable_module_names, decode_forward
from loraplex_engine.memory.fake_model import keep_index_values, with_layers
from loraplex_engine.memory.plan_sharding import (
    ALL_GATHER,
    fake_world,
    rank_rows,
    shard_base,
    tag_all_gathers,
)
from loraplex_engine.memory.tracker import LiveBytes, Peak, storage_bytes
from loraplex_engine.rollout.base import RolloutRequest
from loraplex_engine.rollout.torch.backend import _shared_prefill
from loraplex_engine.rollout.torch.packing import kv_tokens, pack_rollout
from loraplex_engine.rollout.torch.sampling import Sampler
from loraplex_engine.spec.api_types import DEFAULT_MICRO_BATCH_TOKENS, DEFAULT_ROLLOUT_KV_TOKENS
from loraplex_engine.train.algorithms import ClippedRatioLoss
from loraplex_engine.train.chunked_logprobs import DEFAULT_CHUNK_TOKENS, HiddenStatesForward
from loraplex_engine.train.optim import AdamWSettings, PerAdapterAdamW
from loraplex_engine.train.rows import TrainRow
from loraplex_engine.train.step import fused_backward

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CPU = torch.device("cpu")


def _cpu_flash_flops(q: Any, k: Any, v: Any, *_args: Any, **_kw: Any) -> int:
    return flop_counter.sdpa_flop_count(q, k, v)


def _cpu_flash_backward_flops(grad: Any, q: Any, k: Any, v: Any, *_a: Any, **_kw: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad, q, k, v)


# The CPU's fused attention kernels, which torch's FLOP counter does not know (it counts
# their CUDA twins): the same dense formulas.
CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flops,
}


@dataclass(frozen=True)
class Workload:
    """What the engine runs: ``adapters`` tenants, each a GRPO step of
    ``prompts_per_tenant`` prompts x ``completions_per_prompt`` samples."""

    adapters: int
    rank: int
    targets: tuple[str, ...] | None = None  # None: what the engine wraps (every linear,
    # the head too when untied: multi_lora.adaptable_module_names)
    prompts_per_tenant: int = 4
    completions_per_prompt: int = 8
    prompt_tokens: int = 256
    completion_tokens: int = 1024
    dtype: str = "bfloat16"
    lora_dtype: str = "float32"  # LoRA master weights and Adam moments
    checkpointing: bool = False
    micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS
    rollout_kv_tokens: int = DEFAULT_ROLLOUT_KV_TOKENS
    micro_batches: int = 2
    decode_steps: int = 2
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    world_size: int = 1  # ranks of one engine; each trains and decodes its share of rows
    shard_base: bool = False  # FSDP2 over the ranks (memory/plan_sharding.py); else replicated

    def __post_init__(self) -> None:
        names = ("adapters", "rank", "prompts_per_tenant", "completions_per_prompt",
                 "micro_batch_tokens", "rollout_kv_tokens", "world_size")  # fmt: skip
        for name in names:
            if getattr(self, name) < 1:
                raise ValueError(f"workload.{name} must be at least 1")
        if self.prompt_tokens < 2 or self.completion_tokens < 2:
            raise ValueError("workload.prompt_tokens and completion_tokens must be at least 2")
        for name in ("dtype", "lora_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"workload.{name} must be one of {sorted(DTYPES)}")
        if self.micro_batches < 2 or self.decode_steps < 2:
            raise ValueError("workload.micro_batches and decode_steps must be at least 2")
        if self.shard_base and self.world_size < 2:
            raise ValueError("workload.shard_base needs world_size of at least 2")

    @property
    def rows_per_tenant(self) -> int:
        return self.prompts_per_tenant * self.completions_per_prompt

    @property
    def row_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def load_config(path: str | Path) -> PretrainedConfig:
    """A Hugging Face config: a ``config.json``-style file, or a directory holding one."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no model config at {file}")
    values = json.loads(file.read_text())
    if "model_type" not in values:
        raise ValueError(f"{file}: no model_type field")
    return AutoConfig.for_model(**values)


def plan(
    config: PretrainedConfig,
    workload: Workload,
    device_bytes: int,
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
    cut_layers: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Peak bytes per phase and training FLOPs of ``workload`` (see the module doc).

    ``cut_layers=(a, b)``: measure the model cut to ``a`` and to ``b`` decoder layers
    and extend every measured quantity linearly to the model's depth (see
    ``extrapolate``), minutes faster on deep models; ``None`` runs every layer."""
    say = progress or (lambda _msg: None)
    started = time.monotonic()
    layers = int(config.get_text_config().num_hidden_layers)
    depths: int | list[int] = layers
    if cut_layers is None or cut_layers[1] >= layers:
        measured = _measure(config, workload, say)
    else:
        depths = list(cut_layers)
        low, high = cut_layers
        if not 1 <= low < high:
            raise ValueError(f"cut_layers must be two depths a < b, got {cut_layers}")
        cuts = [_measure(with_layers(config, n), workload, say) for n in (low, high)]
        measured = extrapolate(cuts[0], cuts[1], low, high, layers)
    train, kv = measured["train"], measured["kv"]
    tokens = train["tokens"] * train["scale"]
    floor = floor_flops(config, measured["p_base"], measured["p_lora"], tokens,
                        workload.row_tokens)  # fmt: skip
    label = name or str(getattr(config, "model_type", "model"))
    peaks = {k: Peak(v["bytes"], v["by_tag"]) for k, v in measured["peaks"].items()}
    row = _report(label, workload, device_bytes, measured["sizes"], peaks, train, kv, floor)
    row["detail"]["measured_layers"] = depths  # a list: cut and extrapolated
    row["detail"]["plan_seconds"] = round(time.monotonic() - started, 1)
    return row


def _measure(
    config: PretrainedConfig, workload: Workload, say: Callable[[str], None]
) -> dict[str, Any]:
    """Everything the report needs, measured on ``config`` as it is (every number is
    a count of bytes, FLOPs, weights or rows: ``extrapolate`` extends them by depth)."""
    started = time.monotonic()
    vocab = config.get_text_config().vocab_size
    tracker = LiveBytes(
        tag_of=lambda t: "logits" if t.dim() and t.shape[-1] == vocab else "",
        fake_scalars=True,
        track_resize=True,
    )
    world = workload.world_size if workload.shard_base else 1
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_world(world) as mesh, keep_index_values(), tag_all_gathers(tracker), fake, tracker:
        with tracker.in_phase("base"):
            base = AutoModelForCausalLM.from_config(config, dtype=DTYPES[workload.dtype])
            base = base.eval()
        with tracker.in_phase("adapters"):
            model, optimizer = _adapters(base, workload)
        p_base, p_lora = linear_weights(model, workload.rank)
        if mesh is not None:
            shard_base(model, mesh)
        sizes = _static_sizes(base, model, optimizer)
        say(f"base built ({time.monotonic() - started:.1f}s)")
        train = _train_step(model, workload, config, tracker)
        with tracker.in_phase("optimizer"):
            optimizer.step(sorted(model.adapters().values()))
        grads = [p.grad for p in optimizer.params if p.grad is not None]
        sizes["grads"] = storage_bytes(grads)
        say(f"training step ({time.monotonic() - started:.1f}s)")
        with tracker.in_phase("rollout"):  # the next step's rollout: gradients held
            kv = _rollout(model, workload)
        say(f"rollout ({time.monotonic() - started:.1f}s)")
    peaks = {k: {"bytes": v.bytes, "by_tag": dict(v.by_tag)} for k, v in tracker.peaks.items()}
    return {"sizes": sizes, "peaks": peaks, "train": train, "kv": kv,
            "p_base": p_base, "p_lora": p_lora}  # fmt: skip


def extrapolate(low: Any, high: Any, at_low: int, at_high: int, layers: int) -> Any:
    """``low`` and ``high`` (nested dicts of numbers, measured on ``at_low`` and
    ``at_high`` decoder layers) extended linearly to ``layers``. Exact for whatever is
    affine in the depth: the base, slots, gradients, Adam, KV cache and FLOPs are sums
    over identical layers plus the embeddings and head, and a peak is too while the
    same moment stays the peak (saved activations or checkpointed inputs per layer, one
    layer's recompute, FSDP's unsharded groups in flight). Integers stay integers;
    what is equal at both depths (row and micro-batch counts) is kept."""
    if isinstance(low, dict):
        keys = [*low, *(k for k in high if k not in low)]
        return {k: extrapolate(low.get(k, 0), high.get(k, 0), at_low, at_high, layers)
                for k in keys}  # fmt: skip
    if low == high or isinstance(low, bool):
        return low
    value = low + (high - low) * (layers - at_low) / (at_high - at_low)
    return round(value) if isinstance(low, int) and isinstance(high, int) else value


def _adapters(base: nn.Module, w: Workload) -> tuple[MultiLoRAModel, PerAdapterAdamW]:
    """The engine's slots (``adapters`` of them, at ``rank``) and optimiser, all full."""
    targets = w.targets or adaptable_module_names(base)
    model = MultiLoRAModel(base, w.adapters, w.rank, targets, dtype=DTYPES[w.lora_dtype])
    optimizer = PerAdapterAdamW(model)
    config = LoRAConfig(rank=w.rank, alpha=2.0 * w.rank, target_modules=tuple(model.target_modules))
    for i in range(w.adapters):
        model.add_adapter(f"tenant-{i}", config, seed=i)
        optimizer.add_adapter(f"tenant-{i}", AdamWSettings(lr=1e-5))
    return model, optimizer


def _static_sizes(
    base: nn.Module, model: MultiLoRAModel, optimizer: PerAdapterAdamW
) -> dict[str, int]:
    lora = [p for layer in model.lora_layers.values() for p in (layer.lora_A, layer.lora_B)]
    base_tensors = [*base.parameters(), *base.buffers()]
    lora_ids = {id(p) for p in lora} | {
        id(b) for m in model.lora_layers.values() for b in m.buffers()
    }
    return {
        "base": storage_bytes([t for t in base_tensors if id(t) not in lora_ids]),
        "slots": storage_bytes(lora),
        "adam": storage_bytes([*optimizer.exp_avg.values(), *optimizer.exp_avg_sq.values()]),
    }


def tenant_rows(model: MultiLoRAModel, w: Workload, tenants: int) -> list[TrainRow]:
    """GRPO rows as ``Engine._train_rows`` builds them: one group per prompt."""
    rows = []
    for t in range(tenants):
        name = f"tenant-{t}"
        slot = model.slot_of(name)
        for group in range(w.prompts_per_tenant):
            prompt = [(7 * group + i) % 97 + 3 for i in range(w.prompt_tokens)]
            for k in range(w.completions_per_prompt):
                done = [(5 * k + i) % 89 + 3 for i in range(w.completion_tokens)]
                old = [-1.0] * len(done)
                rows.append(TrainRow(name, slot, prompt, done, old, 0.5 - k % 2, 1.0, group))
    return rows


def my_rows(model: MultiLoRAModel, w: Workload) -> list[TrainRow]:
    """The rows one rank trains and decodes: every tenant's, or rank 0's share of them
    under data parallelism (plan_sharding.rank_rows: the engine's split)."""
    rows = tenant_rows(model, w, w.adapters)
    return rank_rows(rows, w.world_size) if w.world_size > 1 else rows


def _train_step(
    model: MultiLoRAModel, w: Workload, config: PretrainedConfig, tracker: LiveBytes
) -> dict[str, Any]:
    """The first ``micro_batches`` micro-batches of the step (gradients from zero), then
    one micro-batch again under ``FlopCounterMode`` for the FLOPs.

    Two runs because the FLOP counter's module hooks keep a checkpointed layer's
    recomputed activations alive through the backward (measured: the peak of a
    checkpointed step comes out near the unchecked one's under the counter).
    """
    rows_per_batch = max(1, w.micro_batch_tokens // w.row_tokens)
    mine = my_rows(model, w)
    run_rows = min(len(mine), rows_per_batch * w.micro_batches)
    rows = mine[:run_rows]
    losses = {r.experiment: ClippedRatioLoss() for r in rows}
    forward = HiddenStatesForward(model, CPU, w.chunk_tokens)
    pad = config.pad_token_id or 0
    for layer in model.lora_layers.values():
        layer.lora_A.grad = layer.lora_B.grad = None
    with tracker.in_phase("train"):
        stats = fused_backward(forward, rows, losses, pad, w.micro_batch_tokens,
                               gradient_checkpointing=w.checkpointing)  # fmt: skip
    counted = rows[:rows_per_batch]
    flop_mode = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)
    with tracker.in_phase("flops"), flop_mode as flops:
        once = fused_backward(forward, counted, losses, pad, w.micro_batch_tokens,
                              gradient_checkpointing=w.checkpointing)  # fmt: skip
    return {
        "flops": flops.get_total_flops(),
        "tokens": once.computed_tokens,
        "scale": len(mine) / len(counted),
        "rank_rows": len(mine),
        "micro_batches": stats.micro_batches,
        "total_micro_batches": math.ceil(len(mine) / rows_per_batch),
    }


def _cache_bytes(past: Any) -> int:
    layers = getattr(past, "layers", [])
    return storage_bytes([t for layer in layers for t in (layer.keys, layer.values)])


def largest_micro_batch(
    w: Workload, slots: list[int], units: set[tuple[str, int]] | None = None
) -> tuple[list[RolloutRequest], int]:
    """The rollout's largest micro-batch (rows x padded tokens) under ``rollout_kv_tokens``,
    as the engine packs every tenant's rows (tenant ``t`` in ``slots[t]``), or only the
    prompt groups in ``units`` (``(tenant name, group)``: a rank's share), and how many
    micro-batches the rollout decodes."""

    def prompt(group: int) -> list[int]:  # as tenant_rows: one prompt per GRPO group
        return [(7 * group + i) % 97 + 3 for i in range(w.prompt_tokens)]

    requests = [
        RolloutRequest(slots[t], prompt(g), w.completion_tokens, 1.0, group=f"tenant-{t}")
        for t in range(w.adapters)
        for g in range(w.prompts_per_tenant)
        for _ in range(w.completions_per_prompt)
        if units is None or (f"tenant-{t}", g) in units
    ]
    batches = pack_rollout(requests, w.rollout_kv_tokens)
    biggest = max(batches, key=lambda b: kv_tokens(requests, b))
    return [requests[i] for i in biggest], len(batches)


@torch.no_grad()
def _rollout(model: MultiLoRAModel, w: Workload) -> dict[str, int]:
    """The largest micro-batch the torch rollout decodes: its prefill, then
    ``decode_steps`` steps of the engine's sampler and forward."""
    slots = [model.slot_of(f"tenant-{t}") for t in range(w.adapters)]
    units = {(r.experiment, r.group) for r in my_rows(model, w)} if w.world_size > 1 else None
    requests, batches = largest_micro_batch(w, slots, units)
    forward = decode_forward(model)
    logits, past, mask, positions = _shared_prefill(model.route, forward, requests, 0)
    sampler = Sampler(requests, logits.device)
    sizes = [_cache_bytes(past)]
    step_pos = positions[:, -1:]
    with model.route(torch.tensor([r.slot for r in requests], dtype=torch.long)):
        for _ in range(w.decode_steps):
            tokens = sampler.step(logits).tokens[:, None]
            mask = torch.cat([mask, torch.ones_like(tokens)], dim=1)
            step_pos = step_pos + 1
            logits, past = forward(tokens, mask, step_pos, past)
            sizes.append(_cache_bytes(past))
    per_step = sizes[-1] - sizes[-2]
    remaining = w.completion_tokens - 1 - w.decode_steps
    final = sizes[-1] + per_step * remaining
    return {"measured": sizes[-1], "per_token": per_step // len(requests), "final": final,
            "rows": len(requests), "micro_batches": batches}  # fmt: skip


def floor_flops(
    config: PretrainedConfig, base_linear: int, lora: int, tokens: int, length: int
) -> float:
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    attention = 4 * text.num_hidden_layers * heads * head_dim * length
    return float((4 * base_linear + 6 * lora) * tokens + 3 * attention * tokens)


def linear_weights(model: MultiLoRAModel, rank: int) -> tuple[int, int]:
    """(P, P_L): base linear weights (head included), one adapter's LoRA weights."""
    base = sum(m.weight.numel() for m in model.base_model.modules() if type(m) is nn.Linear)
    lora = sum(rank * (m.in_features + m.out_features) for m in model.lora_layers.values())
    return base, lora


def _report(
    name: str,
    w: Workload,
    device_bytes: int,
    sizes: dict[str, int],
    peaks: dict[str, Peak],
    train: dict[str, Any],
    kv: dict[str, int],
    floor: float,
) -> dict[str, Any]:
    adapters = sizes["slots"] + sizes["grads"] + sizes["adam"]
    step = peaks["train"]
    logits = step.by_tag.get("logits", 0)
    gathered = step.by_tag.get(ALL_GATHER, 0)
    rollout_total = peaks["rollout"].bytes + kv["final"] - kv["measured"]
    train_total = max(step.bytes, peaks["optimizer"].bytes)
    total = max(train_total, rollout_total)
    train_flops = train["flops"] * train["scale"]
    return {
        "model": name,
        "world_size": w.world_size,
        "shard_base": w.shard_base,
        "dtype": w.dtype,
        "adapters": w.adapters,
        "rank": w.rank,
        "targets": sorted(w.targets) if w.targets else "engine-default",
        "rows_per_tenant": w.rows_per_tenant,
        "prompt_tokens": w.prompt_tokens,
        "completion_tokens": w.completion_tokens,
        "checkpointing": w.checkpointing,
        "peak_bytes": {
            "total": total,
            "base": sizes["base"],
            "adapters": adapters,
            "activations": step.bytes - sizes["base"] - adapters - logits - gathered,
            "logits": logits,
            "kv_cache": kv["final"],
            "all_gather": gathered,  # FSDP's unsharded groups at the training peak
        },
        "train_flops": train_flops,
        "floor_flops": floor,
        "detail": {
            "device_bytes": device_bytes,
            "train_peak": step.bytes,
            "optimizer_step_peak": peaks["optimizer"].bytes,
            "train_total": train_total,
            "rollout_peak": rollout_total,
            "train_fits": train_total <= device_bytes,
            "train_free_fraction": 1 - train_total / device_bytes,
            "adapter_parts": {k: sizes[k] for k in ("slots", "grads", "adam")},
            "kv_bytes_per_token": kv["per_token"],
            "rollout_kv_tokens": w.rollout_kv_tokens,
            "rank_rows": train["rank_rows"],
            "rollout_micro_batch_rows": kv["rows"],
            "rollout_micro_batches": kv["micro_batches"],
            "flops_over_floor": train_flops / floor,
            "micro_batch_tokens": w.micro_batch_tokens,
            "micro_batches_run": train["micro_batches"],
            "micro_batches_per_step": train["total_micro_batches"],
            "workload": asdict(w),
        },
    }
