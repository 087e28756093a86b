"""What the client models use of the engine, each part handed to them by name
(engine_parts.client_parts): the slots and the optimiser they train in, the checkpoint
volume they save to, the publisher whose versions they sample, the model lock and the
tick's wake-up. Nothing here reaches into the Engine."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex_engine.base_model import hub_id_of
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.memory.paging import AdapterPager
from loraplex_engine.plan.limits import EngineLimits
from loraplex_engine.store.quota import CheckpointQuota
from loraplex_engine.tenancy.work_limits import WorkLimits
from loraplex_engine.tokens import TokenCodec
from loraplex_engine.train.optim import PerAdapterAdamW
from loraplex_engine.train.strategy import TrainingStrategy
from loraplex_engine.versions.publisher import Publisher


@dataclass(frozen=True)
class ClientParts:
    model: MultiLoRAModel  # the engine's slots: client models' adapters live there too
    optimizer: PerAdapterAdamW  # their AdamW state, per adapter
    root: Path  # the checkpoint volume (clients/saved.py lays their states out under it)
    quota: CheckpointQuota | None  # a namespace's share of it; None: unbounded
    codec: TokenCodec
    strategy: TrainingStrategy  # the fused update their train calls ride
    publisher: Publisher  # published versions a sample call may name
    work_limits: WorkLimits  # a completion's bounds (prompt, step, context)
    plan_limits: EngineLimits  # what a client's lora_config is granted against (plan/)
    device: torch.device
    model_name: str  # the base model's
    model_dir: Path
    context_tokens: int | None
    max_step_tokens: int  # the tick's client work is shared out in these
    one_rank_torch: bool  # client training needs one rank decoding with torch
    pager: AdapterPager  # models beyond the slots wait paged out (memory/paging.py)
    model_lock: threading.RLock  # held for a whole tick and for slot changes
    wake: Callable[[], None]  # a call was queued: the loop runs a tick

    @property
    def tokenizer_id(self) -> str:
        """What the Tinker SDK's ``get_tokenizer`` loads: the model's hub id where it has
        one, else its directory as an absolute path (a relative one means nothing to a
        client started elsewhere)."""
        return hub_id_of(self.model_dir) or str(self.model_dir.resolve())
