"""A frozen base sharded over the data-parallel ranks with FSDP2 (``--shard-base``).

What is sharded: each decoder layer is its own ``fully_shard`` unit, then the decoder
body (embeddings, final norm) is the root unit; a layer's weights are all-gathered for
its forward (and again for its backward) and freed after, so a rank holds 1/N of the
base plus one layer at a time.

What is replicated, and why:

- **The multi-LoRA slot tensors** (``lora_A``/``lora_B`` of every layer, passed as
  ``ignored_params``): they stay plain tensors, so the bucketed LoRA all-reduce
  (parallel/distributed.py), the per-adapter AdamW (its state small and identical on every
  rank), slot add/remove, the PEFT checkpoints (nothing to gather) and the vLLM sync see
  what they saw unsharded, and no DTensor ever reaches a checkpoint. They are tiny next
  to the base (a rank-16 slot of an 8B model is ~0.1% of it).
- **The output head** (``lm_head``): the log-probs are computed from its weight chunk by
  chunk (train/chunked_logprobs.py) and, for a LoRA-targeted head, in data-dependent numbers
  of calls: sharded, each call would be a collective whose count differs per rank.
  Replicated, the head costs ``vocab x hidden`` per rank (2.1 GB for Llama-3.1-70B in
  bf16). A tied head is the embedding's weight, so a tied model's embedding stays
  replicated too (its parameter is ignored with the head's).

Every sharded forward and backward is a collective, so the ranks must run the same
sequence of them: ``Lockstep`` (the rollout's decode steps, the update's micro-batches;
a rank out of work runs dummy ones). The embeddings' output is made to require grad so
that every layer's backward runs on every rank whatever its adapters target (an
adapter on ``lm_head`` alone would otherwise skip the layers' backward on one rank and
not on another).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers.modeling_layers import GradientCheckpointingLayer

from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.parallel.distributed import World
from loraplex_engine.parallel.lockstep import Lockstep
from loraplex_engine.spec.errors import UsageError

log = logging.getLogger("loraplex_engine.parallel.sharding")


def lora_params(model: MultiLoRAModel) -> set[nn.Parameter]:
    """Every multi-LoRA layer's own stacked parameters (kept replicated)."""
    return {p for layer in model.lora_layers.values() for p in layer.parameters(recurse=False)}


def decoder_layers(base: nn.Module) -> list[nn.Module]:
    """The decoder layers (the modules transformers checkpoints), in order."""
    return [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]


def shard_base(model: MultiLoRAModel, world: World, device: torch.device) -> None:
    """FSDP2 over ``world`` (the default process group, formed): each decoder layer, then
    the decoder body as the root; the LoRA tensors and the head stay replicated."""
    base = model.base_model
    body = getattr(base, "base_model", None)  # the causal LM's decoder (``.model``)
    layers = decoder_layers(base)
    if body is None or body is base or not layers:
        raise UsageError(f"--shard-base: {type(base).__name__} has no decoder layers to shard")
    mesh = init_device_mesh(device.type, (world.size,))
    ignored = lora_params(model)
    head = base.get_output_embeddings()
    if head is not None:
        ignored |= set(head.parameters())  # replicated (see the module doc)
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
    fully_shard(body, mesh=mesh, ignored_params=ignored)
    embed = base.get_input_embeddings()
    embed.register_forward_hook(_require_grad)


def shard_engine_base(model: MultiLoRAModel, world: World | None, device: torch.device) -> Lockstep:
    """An engine's ``--shard-base``: its base sharded over ``world``; the lockstep its
    collectives then need (its rollouts' and its updates')."""
    if world is None or world.size < 2:
        raise UsageError("--shard-base needs --world-size above 1 (the ranks to shard over)")
    shard_base(model, world, device)
    log.info("base sharded over %d ranks (FSDP2); prompt-prefix sharing off", world.size)
    return Lockstep(device)


def _require_grad(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
    """The embeddings' output requires grad while grad is on: every layer's backward (a
    collective under FSDP) then runs on every rank, whatever the adapters target."""
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.requires_grad_(True)
    return output


def is_sharded(model: MultiLoRAModel) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.base_model.modules())


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor, else ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [local_tensor(t) for t in tensors]
