"""What one engine of a pool holds (``spec.capacity``: adapter slots, the highest rank,
memory budgets) and the base model's dimensions that size one adapter
(``spec.modelShape``, or the shape the engines report on /v1/capacity): the numbers
placement packs experiments by.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from loraplex_operator.api.schema import ApiModel, Cel, Int32, Int64


class Capacity(ApiModel):
    """What one engine holds; placement never puts more on an engine."""

    max_adapters: Int32 = Field(
        8,
        alias="maxAdapters",
        ge=1,
        le=256,
        description="Adapter slots per engine, i.e. experiments it trains at once (`serve "
        "--max-adapters`); every rank of a multi-GPU engine holds them all.",
    )
    max_rank: Int32 = Field(
        64,
        alias="maxRank",
        ge=1,
        le=256,
        description="Highest LoRA rank an engine holds (`serve --max-rank`); an experiment "
        "with a higher spec.lora.rank is not admitted.",
    )
    memory_bytes: Int64 = Field(
        0,
        alias="memoryBytes",
        ge=0,
        description="Adapter memory budget per engine in bytes, per rank (GPU) when "
        "gpusPerEngine is above 1, since every rank holds every slot; 0 = not enforced. Each "
        "experiment costs one slot as the engines report it on /v1/capacity (plan.slotBytes, "
        "one rank's: fp32 weights, gradients and Adam moments at maxRank on every linear the "
        "engine wraps, whatever the experiment's rank); an engine that reports no plan is "
        "estimated from modelShape (one replica: the same on every rank). Nothing is checked "
        "until an engine has answered.",
    )
    micro_batch_tokens: Int32 | None = Field(
        None,
        alias="microBatchTokens",
        ge=1,
        le=1048576,
        description="Padded tokens per training micro-batch (`serve --micro-batch-tokens`). "
        "Absent: each engine derives it from its device's memory and its memory plan "
        "(reported on /v1/capacity as plan.microBatchTokens).",
    )
    rollout_kv_tokens: Int64 | None = Field(
        None,
        alias="rolloutKvTokens",
        ge=1,
        description="KV-cache tokens of one torch rollout micro-batch (`serve "
        "--rollout-kv-tokens`): rows x (longest prompt + largest maxNewTokens). The rollout "
        "decodes its micro-batches one after another, so its cache stays under this many "
        "tokens whatever the number of tenants; an experiment that fits is never split. "
        "Absent: each engine derives it from its memory plan (plan.rolloutKvTokens on "
        "/v1/capacity), else 65536.",
    )
    device_memory_bytes: Int64 | None = Field(
        None,
        alias="deviceMemoryBytes",
        ge=1,
        description="Memory each engine plans against (`serve --device-memory`). Absent: on "
        "a GPU what is free once the engine has loaded, plus what it holds; on a CPU none, so "
        "a CPU engine derives nothing.",
    )
    max_registered: Int32 | None = Field(
        None,
        alias="maxRegistered",
        ge=1,
        description="Adapters (experiments and client models) an engine registers at once "
        "(`serve --max-registered`): maxAdapters of them in slots, the rest paged out to host "
        "memory and paged in by the tick that needs them; placement packs an engine up to "
        "this many. At least maxAdapters; above it needs one rank, the torch rollout and the "
        "sync schedule. Absent: maxAdapters (no paging): a pool pages only when it asks to, "
        "since experiments that train every tick gain nothing from taking turns in a slot.",
    )
    host_adapter_memory_bytes: Int64 | None = Field(
        None,
        alias="hostAdapterMemoryBytes",
        ge=1,
        description="Host memory an engine's paged-out adapters may take (`serve "
        "--host-adapter-memory`); past it the ones paged out longest ago are written to the "
        "checkpoint volume and read back when needed. Absent: unbounded.",
    )


class ModelShape(ApiModel):
    """Base model dimensions that size a LoRA adapter: the pool's ``spec.modelShape``, or
    the shape its engines report on /v1/capacity (same camelCase keys)."""

    CEL_RULES: ClassVar = (
        Cel(
            "!has(self.kvDim) || self.kvDim <= self.hiddenSize",
            "modelShape.kvDim must be at most modelShape.hiddenSize",
        ),
    )

    num_layers: Int32 = Field(
        alias="numLayers", ge=1, le=1024, description="Transformer layers of the base model."
    )
    hidden_size: Int32 = Field(
        alias="hiddenSize", ge=1, le=1048576, description="Hidden (model) width."
    )
    intermediate_size: Int32 | None = Field(
        None,
        alias="intermediateSize",
        ge=1,
        le=4194304,
        description="MLP width (gate_proj, up_proj, down_proj); absent = 4 × hiddenSize.",
    )
    kv_dim: Int32 | None = Field(
        None,
        alias="kvDim",
        ge=1,
        le=1048576,
        description="Output width of k_proj and v_proj (smaller than hiddenSize with "
        "grouped-query attention); absent = hiddenSize.",
    )

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a Llama- or Phi-3-style target module; unknown →
        square."""
        h = self.hidden_size
        inter = self.intermediate_size or 4 * h
        kv = self.kv_dim or h
        dims = {
            "q_proj": (h, h),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (h, h),
            "gate_proj": (h, inter),
            "up_proj": (h, inter),
            "down_proj": (inter, h),
            "qkv_proj": (h, h + 2 * kv),  # Phi-3's fused projections
            "gate_up_proj": (h, 2 * inter),
        }
        return dims.get(module, (h, h))
