"""Published adapters sampled for one tick: loaded from their PEFT directory into a free
slot before the rollout and removed after it. A Tinker sampler state
(clients/ticking.py, ``~sample:`` names) and a published version
(``<ns>.<name>@v<N>``, versions/) are served this way: the live slots stay the trained
experiments', and the spare ones cost a slot only while their rows decode. A sampler state
held in memory (clients/sampler_cache.py) comes as its config and tensors instead."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from loraplex_engine.lora.config import LoRAConfig
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.spec.errors import NoCapacityError, NoFreeSlotError
from loraplex_engine.store import checkpoint as ckpt


class SpareSlots:
    def __init__(self, model: MultiLoRAModel) -> None:
        self.model = model
        self.loaded: list[str] = []

    def load(self, name: str, directory: Path, what: str) -> str:
        """Adapter ``name`` from ``directory`` (a no-op when this tick loaded it already);
        NoCapacityError naming ``what`` when no slot is free, CheckpointError when the
        directory is not a loadable adapter."""
        if name not in self.model.adapters():
            try:
                ckpt.load_adapter(self.model, name, directory)
            except NoFreeSlotError as e:
                raise NoCapacityError(f"no spare slot to sample {what}: {e}") from e
            self.loaded.append(name)
        return name

    def load_state(
        self, name: str, config: LoRAConfig, tensors: Mapping[str, torch.Tensor], what: str
    ) -> str:
        """Adapter ``name`` from tensors in memory, as :meth:`load` from a directory."""
        if name not in self.model.adapters():
            try:
                self.model.add_adapter(name, config, 0)  # seeded: the global RNG untouched
            except NoFreeSlotError as e:
                raise NoCapacityError(f"no spare slot to sample {what}: {e}") from e
            self.loaded.append(name)
            self.model.load_adapter_state_dict(name, tensors)
        return name

    def release(self) -> None:
        for name in self.loaded:
            self.model.remove_adapter(name)
        self.loaded = []
