"""How an engine sizes itself: the memory plan it reports on ``/v1/capacity``.

Cheap at start-up, unlike the planner (memory/planner.py, minutes per full-size row), and exact
where the loaded engine knows the answer:

- **static bytes**, read off the tensors the engine holds: the frozen base (parameters
  and buffers), and one adapter slot: its A and B at the engine's max rank on every
  wrapped linear (lora/layers.py stacks every slot at max rank), in fp32, four times over (the
  master weights, their gradient, two Adam moments: train/optim.py), plus its per-slot scale
  and dropout entries. The engine allocates ``max_adapters + 1`` slots (slot 0 is the
  base), every one of them whether it holds an adapter or not;
- **KV bytes per rollout token**, from the config: layers x 2 x kv heads x head dim x
  the dtype's bytes (what the torch rollout's cache holds; the planner measures the same);
- **activation bytes of a training micro-batch**, measured once under ``FakeTensorMode``
  on the engine's own config, targets, rank, dtype and checkpointing, by running the
  engine's ``fused_backward`` on one and two rows of the longest admissible length with
  the gradients already resident (the steady state of every micro-batch but a step's
  first), on the model cut to 2 and 3 decoder layers and extended linearly to its depth
  (Qwen3-4B's shapes: the same bytes as the full 36 layers, in 11-16 s instead of
  50-70 s on 2 shared cores): ``fixed + per_token x tokens + per_slot x adapters in the
  micro-batch`` (the per-slot part: each adapter's A and B cast to the compute dtype,
  kept for the backward by lora/layers.py; a layer at a time under checkpointing).

``derive_budgets`` (pure) then picks what the user did not set: the micro-batch token
budget and the rollout's KV-token budget, both out of the memory the static bytes leave
under ``1 - headroom`` of the device (training and rollout alternate within a tick, so
each may use all of it), and refuses a configuration in which one micro-batch of the
longest row does not fit next to the slots.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from loraplex_engine.lora.layers import LoRAConfig
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.lora.precision import cuda_free_and_total
from loraplex_engine.memory.fake_model import keep_index_values, with_layers
from loraplex_engine.memory.plan_sharding import fsdp_groups, unsharded_reserve
from loraplex_engine.memory.tracker import LiveBytes, storage_bytes
from loraplex_engine.rollout.vllm.config import kv_bytes_per_token
from loraplex_engine.spec.api_types import (
    DEFAULT_MEMORY_HEADROOM,
    DEFAULT_MICRO_BATCH_TOKENS,
    MAX_NEW_TOKENS,
    MemoryPlan,
)
from loraplex_engine.spec.errors import CapacityError
from loraplex_engine.train.algorithms import ClippedRatioLoss
from loraplex_engine.train.chunked_logprobs import HiddenStatesForward
from loraplex_engine.train.rows import TrainRow
from loraplex_engine.train.step import fused_backward

log = logging.getLogger("loraplex_engine.memory.capacity_plan")

# Adapter slot copies the engine keeps: fp32 master, its gradient, Adam's two moments.
SLOT_COPIES = 4
DEFAULT_HEADROOM = DEFAULT_MEMORY_HEADROOM
# The most a derived micro-batch budget grows to: past a few tens of thousands of tokens
# a bigger micro-batch buys no throughput, only transient memory.
MAX_MICRO_BATCH_TOKENS = 65536
# The activation cost is measured on the model cut to this many decoder layers and
# extended linearly to its depth (not one layer: with checkpointing, a one-layer model
# peaks in another place than a deep one does).
CUT_LAYERS = (2, 3)
CPU = torch.device("cpu")


@dataclass(frozen=True)
class StaticBytes:
    base: int  # the frozen base's parameters and buffers (sharded: this rank's, plus
    # the unsharded copies FSDP holds at once: plan_sharding.fsdp_groups)
    slot: int  # one adapter slot at max rank, every copy (SLOT_COPIES) and buffer
    slots: int  # slots allocated: max_adapters + 1 (slot 0 is the base's)

    @property
    def total(self) -> int:
        return self.base + self.slot * self.slots


def static_bytes(model: MultiLoRAModel) -> StaticBytes:
    """The frozen base's and one slot's bytes, from the tensors ``model`` holds. A base
    sharded by FSDP2 counts this rank's shards plus what FSDP holds unsharded at once
    (plan_sharding.unsharded_reserve: as the planner measured it)."""
    layers = list(model.lora_layers.values())
    lora_ids = {id(t) for layer in layers for t in _slot_tensors(layer)}
    base = model.base_model
    tensors = [t for t in (*base.parameters(), *base.buffers()) if id(t) not in lora_ids]
    gathered = unsharded_reserve(*fsdp_groups(base))
    slot = 0
    for layer in layers:
        weights = layer.lora_A[0].numel() + layer.lora_B[0].numel()
        slot += SLOT_COPIES * weights * layer.lora_A.element_size()
        slot += sum(b[0].numel() * b.element_size() for b in layer.buffers(recurse=False))
    return StaticBytes(storage_bytes(tensors) + gathered, slot, model.max_adapters + 1)


def _slot_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """A multi-LoRA layer's own stacked tensors (not its frozen ``base_layer``'s)."""
    return [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]


@dataclass(frozen=True)
class ActivationCost:
    """Bytes one training micro-batch adds over the static bytes, at its peak."""

    fixed: int  # whatever its size: the head's log-prob chunk, masks' fixed parts
    per_token: int  # per padded token
    per_slot: int  # per adapter with rows in the micro-batch

    def bytes(self, tokens: int, slots: int) -> int:
        return self.fixed + self.per_token * tokens + self.per_slot * slots


def measure_activations(
    config: PretrainedConfig,
    dtype: torch.dtype,
    targets: Sequence[str],
    max_rank: int,
    row_tokens: int,
    prompt_tokens: int,
    checkpointing: bool,
) -> ActivationCost:
    """``ActivationCost`` of the engine's training step on this config, measured under
    ``FakeTensorMode`` (no storage): micro-batches of one row of one adapter, two rows of
    one adapter and two rows of two adapters, each row ``row_tokens`` long
    (``prompt_tokens`` of them prompt), on the model cut to one and to two decoder layers;
    each peak is extended linearly to the model's layers (decoder layers alike), so the
    cost is seconds whatever the model's depth."""
    layers = int(config.get_text_config().num_hidden_layers)
    shape = (dtype, targets, max_rank, row_tokens, prompt_tokens, checkpointing)
    low, high = min(layers, CUT_LAYERS[0]), min(layers, CUT_LAYERS[1])
    peaks = _peaks(with_layers(config, low), *shape)
    if high > low:
        upper = _peaks(with_layers(config, high), *shape)
        slope = [(b - a) / (high - low) for a, b in zip(peaks, upper, strict=True)]
        peaks = [round(a + (layers - low) * d) for a, d in zip(peaks, slope, strict=True)]
    one, two, mixed = peaks
    per_token = max(0, math.ceil((two - one) / row_tokens))
    per_slot = max(0, mixed - two)
    return ActivationCost(max(0, one - per_token * row_tokens - per_slot), per_token, per_slot)


def _peaks(
    config: PretrainedConfig,
    dtype: torch.dtype,
    targets: Sequence[str],
    max_rank: int,
    row_tokens: int,
    prompt_tokens: int,
    checkpointing: bool,
) -> list[int]:
    """Peak bytes over the static ones of the three micro-batches (measure_activations)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    tracker = LiveBytes(fake_scalars=True)
    with keep_index_values(), FakeTensorMode(allow_non_fake_inputs=True), tracker:
        base = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        model = MultiLoRAModel(base, 2, max_rank, list(targets), dtype=torch.float32)
        names = tuple(sorted(model.target_modules))
        for i in range(2):
            lora = LoRAConfig(max_rank, 2.0 * max_rank, target_modules=names)
            model.add_adapter(f"tenant-{i}", lora, seed=i)
        rows = (row_tokens, prompt_tokens, checkpointing)
        return [
            _peak_over_static(model, tracker, tenants, *rows)
            for tenants in (["tenant-0"], ["tenant-0", "tenant-0"], ["tenant-0", "tenant-1"])
        ]


def _peak_over_static(
    model: MultiLoRAModel,
    tracker: LiveBytes,
    tenants: list[str],
    row_tokens: int,
    prompt_tokens: int,
    checkpointing: bool,
) -> int:
    """Peak bytes of one micro-batch (a row per entry of ``tenants``) over what was live
    before it, with the slots' gradients already allocated (as after a first one)."""
    for layer in model.lora_layers.values():
        for p in (layer.lora_A, layer.lora_B):
            p.grad = torch.zeros_like(p)
    prompt = [(7 * i) % 97 + 3 for i in range(prompt_tokens)]
    done = [(5 * i) % 89 + 3 for i in range(row_tokens - prompt_tokens)]
    batch = [
        TrainRow(name, model.slot_of(name), prompt, done, [-1.0] * len(done), 0.5 - k % 2, 1.0, k)
        for k, name in enumerate(tenants)
    ]
    losses = {name: ClippedRatioLoss() for name in tenants}
    try:
        forward = HiddenStatesForward(model, CPU)
    except ValueError:  # a head that transforms its logits: the engine's full-logits path
        forward, checkpointing = _routed_forward(model), False
    with tracker.in_phase(f"micro-batch-{len(tenants)}") as peak:
        before = tracker.live
        fused_backward(forward, batch, losses, 0, len(batch) * row_tokens,
                       gradient_checkpointing=checkpointing)  # fmt: skip
    return peak.bytes - before


def _routed_forward(model: MultiLoRAModel):  # type: ignore[no-untyped-def]
    def forward(ids: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, attention_mask=mask, slot_ids=slots).logits.float()

    return forward


# --- choosing the budgets (pure) ------------------------------------------------------


@dataclass(frozen=True)
class Budgets:
    micro_batch_tokens: int
    rollout_kv_tokens: int | None  # None: not bounded by the plan (vLLM sizes its own)
    free_bytes: int | None  # what the static bytes leave under the headroom
    derived: tuple[str, ...]  # which of the two the plan chose (the others were set)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def derive_budgets(
    *,
    device_bytes: int | None,
    static: StaticBytes,
    activations: ActivationCost | None,
    kv_per_token: int | None,
    longest_row: int,
    headroom: float = DEFAULT_HEADROOM,
    micro_batch_tokens: int | None = None,
    rollout_kv_tokens: int | None = None,
    plan_rollout: bool = True,
) -> Budgets:
    """The micro-batch and rollout KV-token budgets: those given are kept, the others
    chosen to fill what the static bytes leave of ``(1 - headroom) x device_bytes``.

    A micro-batch holds at least one row (training.pack_micro_batches), so the smallest
    useful budget is ``longest_row``; a derived one is at most MAX_MICRO_BATCH_TOKENS.
    The micro-batch is sized for every slot's adapter in it at once. Raises
    CapacityError when even one slot and one micro-batch of the longest row do not fit.
    Without ``device_bytes`` nothing is derived: the defaults apply.
    """
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"memory headroom must be in [0, 1), got {headroom}")
    derived: list[str] = []
    if device_bytes is None:
        return Budgets(micro_batch_tokens or DEFAULT_MICRO_BATCH_TOKENS, rollout_kv_tokens,
                       None, ())  # fmt: skip
    usable = int(device_bytes * (1.0 - headroom))
    free = usable - static.total
    if activations is not None:
        _check_fits(usable, free, static, activations, longest_row)
    if micro_batch_tokens is None:
        if activations is None:
            micro_batch_tokens = DEFAULT_MICRO_BATCH_TOKENS
        else:
            adapters = static.slots - 1
            room = free - activations.fixed - activations.per_slot * adapters
            fit = room // max(activations.per_token, 1)
            micro_batch_tokens = int(max(longest_row, min(fit, MAX_MICRO_BATCH_TOKENS)))
            derived.append("microBatchTokens")
    if rollout_kv_tokens is None and plan_rollout and kv_per_token:
        rollout_kv_tokens = int(max(longest_row, free // kv_per_token))
        derived.append("rolloutKvTokens")
    return Budgets(micro_batch_tokens, rollout_kv_tokens, free, tuple(derived))


def _check_fits(
    usable: int, free: int, static: StaticBytes, act: ActivationCost, longest_row: int
) -> None:
    """Every slot plus one micro-batch of the longest row (all adapters in it) must fit;
    the message says how many slots would, or that not even one does."""
    adapters = static.slots - 1
    if free >= act.bytes(longest_row, adapters):
        return
    need_one = static.base + 2 * static.slot + act.bytes(longest_row, 1)
    if need_one > usable:
        raise CapacityError(
            f"the base model ({_gib(static.base)}) with one adapter slot ({_gib(static.slot)}"
            f" each, at max rank) and one micro-batch of the longest row ({longest_row} tokens: "
            f"{_gib(act.bytes(longest_row, 1))}) needs {_gib(need_one)}, over the "
            f"{_gib(usable)} planned of this device; lower --max-rank or --max-prompt-tokens, "
            "turn --gradient-checkpointing on, or use a larger device"
        )
    fits = max(
        k for k in range(1, adapters + 1)
        if static.base + (k + 1) * static.slot + act.bytes(longest_row, k) <= usable
    )  # fmt: skip
    raise CapacityError(
        f"{adapters} adapter slots ({_gib(static.slot)} each, at max rank) with the base model "
        f"({_gib(static.base)}) and one micro-batch of the longest row ({longest_row} tokens) "
        f"need more than the {_gib(usable)} planned of this device; --max-adapters {fits} fits"
    )


# --- the engine's plan ----------------------------------------------------------------


def device_memory(device: torch.device, given: int | None) -> tuple[int | None, int | None]:
    """(the device's total memory, the memory this engine plans against).

    CUDA: ``given`` or, measured once the weights and slots are loaded, what is free
    plus what this process already holds (another process on the GPU, e.g. a vLLM
    worker, keeps its share). CPU: ``given`` only (``serve --device-memory``): a CPU
    engine shares its host, so without it nothing is derived (the defaults apply)."""
    measured = cuda_free_and_total(device)
    if measured is not None:
        free, total = measured
        return total, given or free + torch.cuda.memory_reserved(device)
    import psutil

    return psutil.virtual_memory().total, given


def engine_plan(
    model: MultiLoRAModel,
    *,
    dtype: torch.dtype,
    device: torch.device,
    checkpointing: bool,
    max_prompt_tokens: int,
    device_bytes: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
    micro_batch_tokens: int | None = None,
    rollout_kv_tokens: int | None = None,
    plan_rollout: bool = True,
) -> MemoryPlan:
    """The loaded engine's memory plan: exact static bytes, the analytic KV cost, the
    activation cost measured (only when the micro-batch budget is to be derived), and
    the budgets ``derive_budgets`` keeps or chooses. The longest row is the longest prompt
    the engine admits plus the most new tokens, within the model's context."""
    total, planned = device_memory(device, device_bytes)
    static = static_bytes(model)
    config = model.base_model.config
    context = getattr(config, "max_position_embeddings", None)
    longest_row = max_prompt_tokens + MAX_NEW_TOKENS
    longest_row = longest_row if context is None else min(context, longest_row)
    prompt_tokens = min(max_prompt_tokens, longest_row // 2)
    acts = None
    if planned is not None and micro_batch_tokens is None:
        targets = sorted(model.target_modules)
        acts = measure_activations(config, dtype, targets, model.max_rank, longest_row,
                                   prompt_tokens, checkpointing)  # fmt: skip
    kv = kv_bytes_per_token(config, torch.empty((), dtype=dtype).element_size())
    budgets = derive_budgets(
        device_bytes=planned,
        static=static,
        activations=acts,
        kv_per_token=kv,
        longest_row=longest_row,
        headroom=headroom,
        micro_batch_tokens=micro_batch_tokens,
        rollout_kv_tokens=rollout_kv_tokens,
        plan_rollout=plan_rollout,
    )
    plan = MemoryPlan(
        device_total_bytes=total,
        device_bytes=planned,
        headroom=headroom,
        base_bytes=static.base,
        slot_bytes=static.slot,
        slots=static.slots,
        activation_fixed_bytes=acts.fixed if acts else None,
        activation_bytes_per_token=acts.per_token if acts else None,
        activation_bytes_per_adapter=acts.per_slot if acts else None,
        kv_bytes_per_token=kv,
        micro_batch_tokens=budgets.micro_batch_tokens,
        rollout_kv_tokens=budgets.rollout_kv_tokens,
        derived=list(budgets.derived),
    )
    log.info(
        "memory plan: device %s bytes, base %d, %d slots x %d, micro-batch %d tokens, "
        "rollout KV %s tokens (derived: %s)",
        plan.device_bytes, plan.base_bytes, plan.slots, plan.slot_bytes,
        plan.micro_batch_tokens, plan.rollout_kv_tokens, ", ".join(plan.derived) or "none",
    )  # fmt: skip
    return plan
