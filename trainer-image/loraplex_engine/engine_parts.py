"""The Engine's parts, built from its settings (engine.py composes them): the base model
with its adapter slots, the optimiser, the run store, the rollout backend, the training
strategy, the publisher and the memory plan; then the tick over them and what the client
models receive of them (clients/parts.py).

Each builder takes what it needs by name and returns typed parts, so the Engine's
constructor only wires them together and no part reaches into the Engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loraplex_engine.base_model import default_lora_targets
from loraplex_engine.clients.parts import ClientParts
from loraplex_engine.lora.grouped import KERNEL_MODES
from loraplex_engine.lora.model import MultiLoRAModel, adaptable_module_names, decode_forward
from loraplex_engine.lora.precision import MASTER_DTYPE, enable_tf32, resolve_dtype
from loraplex_engine.memory import spill_owner
from loraplex_engine.memory.capacity_plan import engine_plan
from loraplex_engine.memory.paging import AdapterPager, registered_limit
from loraplex_engine.parallel.data_parallel import (
    DataParallelTraining,
    data_parallel_trainer,
    share_rollouts,
)
from loraplex_engine.parallel.distributed import World
from loraplex_engine.parallel.lockstep import Lockstep
from loraplex_engine.parallel.sharding import shard_engine_base
from loraplex_engine.plan.limits import EngineLimits
from loraplex_engine.rollout.backends import RolloutBackend, TorchRollout
from loraplex_engine.rollout.select import RolloutParts, build_rollout
from loraplex_engine.settings.engine import EngineSettings
from loraplex_engine.spec.api_types import (
    DEFAULT_MICRO_BATCH_TOKENS,
    DEFAULT_ROLLOUT_KV_TOKENS,
    AdapterSyncStats,
    MemoryPlan,
)
from loraplex_engine.store import checkpoint as ckpt
from loraplex_engine.store.quota import CheckpointQuota
from loraplex_engine.store.run_store import RunStore
from loraplex_engine.store.spill_quota import SpillQuota
from loraplex_engine.store.versions import VersionStore
from loraplex_engine.tenancy.work_limits import WorkLimits
from loraplex_engine.tick.fair_share import RewardScorer
from loraplex_engine.tick.pipelined import tick_class
from loraplex_engine.tick.tick import Tick
from loraplex_engine.tokens import TokenCodec
from loraplex_engine.train.optim import PerAdapterAdamW
from loraplex_engine.train.shared_prefix import shared_forward_of
from loraplex_engine.train.strategy import FusedTraining, TrainingStrategy
from loraplex_engine.versions.publisher import Publisher


@dataclass(frozen=True)
class EngineParts:
    """What :func:`build_parts` loads and wires, once, before the Engine serves."""

    model_dir: Path
    model_name: str
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any  # transformers' tokenizer of the base model
    codec: TokenCodec
    model: MultiLoRAModel
    lockstep: Lockstep | None  # a sharded base's collectives (--shard-base)
    default_targets: tuple[str, ...] | None  # what a spec that names no targets gets
    optimizer: PerAdapterAdamW
    store: RunStore
    share_prompt_prefix: bool  # a group's shared prompt runs its forward once
    backend: RolloutBackend
    strategy: TrainingStrategy
    ranks: DataParallelTraining | None  # data parallel: rank 0's view of the workers
    publisher: Publisher
    adapter_sync: AdapterSyncStats | None  # weight syncs to a sampler with its own copy
    memory_plan: MemoryPlan
    context_tokens: int | None  # longest row the base takes; None: not stated
    # One process decodes with the trainer's own weights (torch, one rank, no sharded
    # base): spare slots serve versions, and clients may train models.
    one_rank_torch: bool
    pager: AdapterPager  # registered adapters beyond the slots, paged (memory/paging.py)


def build_parts(
    model_dir: str | Path,
    s: EngineSettings,
    *,
    device: str,
    world: World | None,
    model_name: str | None,
    ignore_eos: bool,
    share_prompt_prefix: bool,
) -> EngineParts:
    """Load the base model and build every part over it (the Engine's constructor's job;
    see engine.Engine for the arguments)."""
    model_dir = Path(model_dir)
    dev = torch.device(device)
    dtype = resolve_dtype(s.dtype, dev)
    enable_tf32(dev)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    # generation_config.json's eos_token_id: an int, a list (Llama 3) or none.
    eos = getattr(getattr(base, "generation_config", None), "eos_token_id", None)
    codec = TokenCodec(tokenizer, eos)
    base.to(dev).eval()
    model = MultiLoRAModel(
        base,
        max_adapters=s.max_adapters,
        max_rank=s.max_rank,
        target_modules=adaptable_module_names(base),
        dtype=MASTER_DTYPE,
        grouped_mm=KERNEL_MODES[s.lora_kernel],
    )
    lockstep = shard_engine_base(model, world, dev) if s.shard_base else None
    optimizer = PerAdapterAdamW(model)
    root, quota = Path(s.checkpoint_root), s.checkpoint_quota_bytes
    quota = CheckpointQuota(quota) if quota is not None else None
    store = RunStore(root, model, optimizer, str(model_dir), quota, s.checkpoint_keep_runs)
    shared = shared_forward_of(model, dev, share_prompt_prefix and lockstep is None)
    # Chosen once; from here on the engine asks the backend what it is (rollout/select.py).
    backend = build_rollout(
        s.rollout_backend,
        RolloutParts(
            model,
            model_dir,
            dev,
            dtype,
            model.route,
            decode_forward(model, dev),
            ckpt.peft_export(model, str(model_dir)),
            codec.pad_id,
            codec.eos_ids,
            ignore_eos,
            s.max_prompt_tokens,
            s.max_step_tokens,
            dict(s.vllm_options),
            world,
            lockstep,
        ),
    )
    strategy = _strategy(s, model, optimizer, dev, codec, shared, backend, world, lockstep)
    # Data parallel: rank 0's adapter adds and removes reach the workers (same slots),
    # and every rank decodes a share of each torch rollout.
    ranks = share_rollouts(strategy, backend)
    # Published versions (versions/): from spare slots where one process decodes (torch).
    one = ranks is None and lockstep is None and backend.shares_trainer_weights
    publisher = Publisher(VersionStore(root, quota), model, model_dir, one)
    return EngineParts(
        model_dir=model_dir,
        model_name=model_name or model_dir.name,
        device=dev,
        dtype=dtype,
        tokenizer=tokenizer,
        codec=codec,
        model=model,
        lockstep=lockstep,
        default_targets=default_lora_targets(model.target_modules),
        optimizer=optimizer,
        store=store,
        share_prompt_prefix=shared is not None,
        backend=backend,
        strategy=strategy,
        ranks=ranks,
        publisher=publisher,
        # Weight syncs to a sampler with its own copy of the adapters (vLLM); torch: None.
        adapter_sync=None if backend.shares_trainer_weights else AdapterSyncStats(),
        memory_plan=_plan_memory(s, model, dtype, dev, strategy, backend),
        # Longest row the base model takes (prompt + completion); None: not stated.
        context_tokens=getattr(base.config, "max_position_embeddings", None),
        one_rank_torch=one,
        pager=AdapterPager(
            model,
            optimizer,
            registered_limit(s.max_adapters, s.max_registered, one and s.schedule == "sync"),
            s.host_adapter_memory,
            _spill_dir(root, s.host_adapter_memory),
            None if quota is None else SpillQuota(quota, root),  # spills count as checkpoints
        ),
    )


def _spill_dir(root: Path, host_budget: int | None) -> spill_owner.SpillDir | None:
    """What dead engines spilled on this volume goes first; this one spills into its own
    directory only when its host memory for pages is bounded."""
    spill_owner.sweep(root)
    return None if host_budget is None else spill_owner.claim(root)


def _strategy(
    s: EngineSettings,
    model: MultiLoRAModel,
    optimizer: PerAdapterAdamW,
    device: torch.device,
    codec: TokenCodec,
    shared: Any,
    backend: RolloutBackend,
    world: World | None,
    lockstep: Lockstep | None,
) -> TrainingStrategy:
    """The training strategy the settings and the process group ask for."""
    gradient_checkpointing = s.gradient_checkpointing
    if gradient_checkpointing is None:
        gradient_checkpointing = device.type == "cuda"
    trainer: Callable[..., TrainingStrategy] = FusedTraining
    if s.train_mode == "timesliced":  # the benchmark's baseline arm: dev code, on request
        from loraplex_engine.dev.timesliced import TimeSlicedTraining

        trainer = TimeSlicedTraining
    if world is not None:  # data parallel over the process group (parallel/data_parallel.py)
        trainer = data_parallel_trainer(world, s.train_mode, lockstep)
    strategy: TrainingStrategy = trainer(
        model,
        optimizer,
        device,
        codec.pad_id,
        s.micro_batch_tokens or DEFAULT_MICRO_BATCH_TOKENS,
        shared,
        gradient_checkpointing=gradient_checkpointing,
        # A sampler with its own kernels (vLLM): the trainer scores the rows itself
        # (train/strategy.AdapterTrainer).
        recompute_old_logprobs=not backend.shares_trainer_weights,
    )
    return strategy


def _plan_memory(
    s: EngineSettings,
    model: MultiLoRAModel,
    dtype: torch.dtype,
    device: torch.device,
    strategy: TrainingStrategy,
    backend: RolloutBackend,
) -> MemoryPlan:
    """Sized once the weights, slots and rollout worker hold their memory; the strategy's
    micro-batch and the torch backend's KV cache take the plan's sizes."""
    plan = engine_plan(
        model,
        dtype=dtype,
        device=device,
        checkpointing=strategy.gradient_checkpointing,
        max_prompt_tokens=s.max_prompt_tokens,
        device_bytes=s.device_memory,
        headroom=s.memory_headroom,
        micro_batch_tokens=s.micro_batch_tokens,
        rollout_kv_tokens=s.rollout_kv_tokens,
        plan_rollout=backend.shares_trainer_weights,  # vLLM sizes its own cache
    )
    strategy.micro_batch_tokens = plan.micro_batch_tokens
    if isinstance(backend, TorchRollout):  # vLLM sizes its own cache
        kv_tokens = plan.rollout_kv_tokens or DEFAULT_ROLLOUT_KV_TOKENS
        backend.kv_tokens = kv_tokens
        plan = plan.model_copy(update={"rollout_kv_tokens": kv_tokens})
    return plan


def build_tick(
    p: EngineParts,
    s: EngineSettings,
    world: World | None,
    scorer: RewardScorer[Any],
    wake: Callable[[], None],
) -> Tick:
    """The tick over the parts: sync, or pipelined (tick/pipelined.py)."""
    tick = tick_class(s.schedule, world)(
        p.model,
        p.codec,
        p.backend,
        p.strategy,
        p.store,
        scorer,
        s.max_prompt_tokens,
        p.context_tokens,
        p.publisher,
        wake=wake,  # a multi-turn step's environment answered after its tick
    )
    tick.attach_streams(p.device, p.memory_plan)  # pipelined: a CUDA side stream
    return tick


def client_parts(
    p: EngineParts,
    limits: WorkLimits,
    plan_limits: EngineLimits,
    model_lock: threading.RLock,
    wake: Callable[[], None],
) -> ClientParts:
    """What the client models (clients/) use of the engine, each part by name."""
    return ClientParts(
        model=p.model,
        optimizer=p.optimizer,
        root=p.store.root,
        quota=p.store.quota,
        codec=p.codec,
        strategy=p.strategy,
        publisher=p.publisher,
        work_limits=limits,
        plan_limits=plan_limits,
        device=p.device,
        model_name=p.model_name,
        model_dir=p.model_dir,
        context_tokens=p.context_tokens,
        max_step_tokens=limits.max_step_tokens,
        one_rank_torch=p.one_rank_torch,
        pager=p.pager,
        model_lock=model_lock,
        wake=wake,
    )
