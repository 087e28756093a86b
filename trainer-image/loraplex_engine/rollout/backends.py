"""The engine's view of a rollout backend: generate rows, and keep adapters in sync.

``TorchRollout`` decodes through the engine's own multi-LoRA model (nothing to sync: the
rollout model is the trained model). The vLLM backend (rollout/vllm/engine_backend.py)
drives vLLM in its worker process and pushes the new weights of each adapter trained in
a tick. Which one an engine runs is chosen once, by name (rollout/select.py); the engine
then asks the backend what it is (``shares_trainer_weights``), never its name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.rollout.torch.backend import ForwardFn, RouteFn, generate
from loraplex_engine.rollout.torch.packing import DEFAULT_ROLLOUT_KV_TOKENS
from loraplex_engine.spec.api_types import AdapterSync

if TYPE_CHECKING:
    from loraplex_engine.lora.model import MultiLoRAModel
    from loraplex_engine.parallel.distributed import World
    from loraplex_engine.parallel.lockstep import Lockstep

log = logging.getLogger("loraplex_engine.rollout")
# An adapter as the sampler takes it: its PEFT adapter_config.json (a dict) and its weights
# under PEFT's key names, on the CPU in the dtype asked for (checkpoint.peft_tensors).
PeftWeights = tuple[dict[str, Any], dict[str, torch.Tensor]]
ExportFn = Callable[[str, torch.dtype], PeftWeights]


@dataclass(frozen=True)
class RolloutParts:
    """What a backend is built from: the engine's model, device and limits."""

    model: MultiLoRAModel
    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    route: RouteFn
    decode_forward: ForwardFn
    export: ExportFn  # an adapter as PEFT config and tensors (a sampler of its own)
    pad_id: int
    eos_ids: Sequence[int]
    ignore_eos: bool
    max_prompt_tokens: int
    max_step_tokens: int
    options: dict[str, Any]  # --vllm-option
    world: World | None = None
    lockstep: Lockstep | None = None


@dataclass
class SyncResult:
    """What ``sync_adapters`` did: the experiments whose update the sampler refused (with
    why), and the sync's measure (None where no weights crossed: the torch rollout, or
    nothing trained)."""

    refused: dict[str, str] = field(default_factory=dict)
    sync: AdapterSync | None = None


class RolloutBackend(Protocol):
    name: str
    # Decodes with the trained model itself: the sampler's log-probs are the trainer's
    # (nothing to recompute), no weights to sync, and its KV cache is the engine's memory.
    shares_trainer_weights: bool

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Completion]: ...

    def add_adapter(self, exp_id: str) -> None: ...

    def sync_adapters(self, exp_ids: Sequence[str]) -> SyncResult:
        """Push the new weights of ``exp_ids`` (the adapters that changed: trained this
        tick); the result names those whose update failed, and measures the sync."""
        ...

    def remove_adapter(self, exp_id: str) -> None: ...

    def training_phase(self) -> AbstractContextManager[None]:
        """Held while the trainer trains: a sampler sharing its device steps aside."""
        ...

    def close(self) -> None: ...


# rows -> every row's completion, decoded over the data-parallel ranks
Distribute = Callable[[Sequence[RolloutRequest]], list[Completion]]


class _TrainedWeights:
    """A rollout that decodes with the trained model's own weights (or, on a worker
    rank, not at all): no adapter of its own to load, sync, remove or put to sleep."""

    shares_trainer_weights = True

    def add_adapter(self, exp_id: str) -> None:
        pass

    def sync_adapters(self, exp_ids: Sequence[str]) -> SyncResult:
        return SyncResult()

    def remove_adapter(self, exp_id: str) -> None:
        pass

    def training_phase(self) -> AbstractContextManager[None]:
        return nullcontext()  # the rollout model is the trained model

    def close(self) -> None:
        pass


class TorchRollout(_TrainedWeights):
    """Decode through the multi-LoRA model with every row routed to its slot, in
    micro-batches of at most ``kv_tokens`` KV-cache tokens (rollout/torch/packing.py).

    Data parallel (parallel/data_parallel.py): ``distribute`` spreads a batch over the ranks,
    each decoding its share with ``generate_local``; ``lockstep`` (a sharded base) keeps
    their forwards in step."""

    name = "torch"

    def __init__(
        self,
        route: RouteFn,
        forward: ForwardFn,
        pad: int,
        eos_ids: Sequence[int],
        kv_tokens: int = DEFAULT_ROLLOUT_KV_TOKENS,
        lockstep: Lockstep | None = None,
    ):
        self._route, self._forward, self._pad, self._eos = route, forward, pad, tuple(eos_ids)
        self.kv_tokens = kv_tokens
        self.lockstep = lockstep
        self.distribute: Distribute | None = None

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Completion]:
        if self.distribute is not None:
            return self.distribute(requests)
        return self.generate_local(requests)

    def generate_local(self, requests: Sequence[RolloutRequest]) -> list[Completion]:
        """This process's rows alone (this rank's share, under data parallelism)."""
        return generate(
            self._route,
            self._forward,
            requests,
            self._pad,
            self._eos,
            self.kv_tokens,
            self.lockstep,
        )


class FollowerRollout(_TrainedWeights):
    """A worker rank's rollout under a vLLM backend: rank 0's vLLM decodes every row
    (parallel/data_parallel.py), so a worker starts no vLLM and never decodes; its adapters change
    only through rank 0's messages, and it takes no training-phase turn of its own."""

    name = "vllm"
    shares_trainer_weights = False  # rank 0's vLLM samples: every rank recomputes

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Completion]:
        raise RuntimeError("a worker rank decodes no vLLM rollout: rank 0's vLLM does")
