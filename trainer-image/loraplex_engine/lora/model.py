"""Wrap a Hugging Face causal LM with multi-LoRA layers: slots, routing, PEFT-named weights."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from loraplex_engine.lora.grouped import check_mode
from loraplex_engine.lora.layers import LoRAConfig, MultiLoRALinear
from loraplex_engine.lora.routing import Router
from loraplex_engine.spec.errors import (
    AdapterError,
    DuplicateAdapterError,
    NoFreeSlotError,
    RankTooLargeError,
    RoutingError,
    UnknownAdapterError,
    UnknownTargetModuleError,
)

PEFT_PREFIX = "base_model.model."


class Reclaimer(Protocol):
    """Holds adapters it can give back (versions/slot_cache.py VersionSlots)."""

    def reclaim(self) -> bool: ...  # evict one; False when none can go

    def evictable(self) -> int: ...


class MultiLoRAModel(nn.Module):
    """A frozen base model whose linear projections each hold ``max_adapters`` LoRA slots.

    Slot 0 is the base model (no adapter); adapters live in slots ``1..max_adapters``.
    ``target_modules`` names the projections to wrap (by last name component); None wraps
    every ``nn.Linear`` except the output head. Each adapter targets a subset of them.
    """

    def __init__(
        self,
        base_model: nn.Module,
        max_adapters: int,
        max_rank: int,
        target_modules: Sequence[str] | None = None,
        dtype: torch.dtype | None = None,
        grouped_mm: str = "auto",
    ) -> None:
        super().__init__()
        if max_adapters < 1 or max_rank < 1:
            raise AdapterError("max_adapters and max_rank must be at least 1")
        check_mode(grouped_mm)
        self.base_model = base_model.requires_grad_(False)
        self.max_adapters = max_adapters
        self.max_rank = max_rank
        self.lora_layers: dict[str, MultiLoRALinear] = _wrap_linears(
            base_model, target_modules, max_adapters + 1, max_rank, dtype
        )
        self.set_grouped_mm(grouped_mm)
        if not self.lora_layers:
            raise UnknownTargetModuleError("the base model has no linear module to wrap")
        self.target_modules = frozenset(p.rsplit(".", 1)[-1] for p in self.lora_layers)
        self._slots: dict[str, int] = {}
        self._configs: dict[str, LoRAConfig] = {}
        # Who holds evictable adapters (versions/slot_cache.py): asked for a slot when
        # none is free, so a cached version never keeps a slot from a trained adapter.
        self.reclaimer: Reclaimer | None = None
        self.training = base_model.training  # keep the base's train/eval mode

    def set_grouped_mm(self, mode: str) -> None:
        """When every layer's delta runs as grouped matmuls: "auto" | "always" | "never"."""
        check_mode(mode)
        for layer in self.lora_layers.values():
            layer.grouped_mm = mode

    # ---- slot management -------------------------------------------------------------

    def add_adapter(self, name: str, config: LoRAConfig, seed: int | None = None) -> int:
        """Put a freshly initialised adapter into a free slot and return the slot."""
        if name in self._slots:
            raise DuplicateAdapterError(f"adapter {name!r} is already loaded")
        self.check_config(config)
        free = self.free_slots(reclaim=True)
        if not free:
            raise NoFreeSlotError(f"all {self.max_adapters} adapter slots are taken")
        slot = free[0]
        self._slots[name], self._configs[name] = slot, config
        self._init_slot(slot, config, seed)
        return slot

    def remove_adapter(self, name: str) -> None:
        slot = self.slot_of(name)
        for layer in self.lora_layers.values():
            layer.set_slot(slot, 0, 0.0, 0.0)
        del self._slots[name], self._configs[name]

    def slot_of(self, name: str) -> int:
        if name not in self._slots:
            raise UnknownAdapterError(f"no adapter named {name!r}; loaded: {sorted(self._slots)}")
        return self._slots[name]

    def config_of(self, name: str) -> LoRAConfig:
        self.slot_of(name)
        return self._configs[name]

    def adapters(self) -> dict[str, int]:
        """Loaded adapters: name -> slot."""
        return dict(self._slots)

    def free_slots(self, reclaim: bool = False) -> list[int]:
        """The empty slots; ``reclaim``: when none is, evictable adapters are evicted
        (``self.reclaim``) until one is or none is left."""
        while True:
            used = set(self._slots.values())
            free = [s for s in range(1, self.max_adapters + 1) if s not in used]
            if free or not reclaim or self.reclaimer is None or not self.reclaimer.reclaim():
                return free

    def has_room(self) -> bool:
        """A slot is free or can be freed (by evicting a cached adapter)."""
        held = self.reclaimer
        return bool(self.free_slots()) or (held is not None and held.evictable() > 0)

    def check_config(self, config: LoRAConfig) -> None:
        """Raise if ``config`` cannot be served by this model (changes nothing)."""
        if config.rank > self.max_rank:
            raise RankTooLargeError(
                f"rank {config.rank} exceeds the engine's max rank {self.max_rank}"
            )
        unknown = sorted(set(config.target_modules) - self.target_modules)
        if unknown:
            raise UnknownTargetModuleError(
                f"unknown target modules {unknown}; this engine wraps {sorted(self.target_modules)}"
            )

    def _init_slot(self, slot: int, config: LoRAConfig, seed: int | None) -> None:
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for path, layer in self.lora_layers.items():  # fixed order: same seed, same weights
            if _is_target(config, path):
                layer.set_slot(slot, config.rank, config.scale, config.dropout, gen)
            else:
                layer.set_slot(slot, 0, 0.0, 0.0)

    # ---- routing ---------------------------------------------------------------------

    @contextmanager
    def route(self, slot_ids: Tensor) -> Iterator[None]:
        """Within the block, row ``i`` of every batch uses slot ``slot_ids[i]``."""
        ranks = {slot: self._configs[name].rank for name, slot in self._slots.items()}
        router = Router(self._check_slot_ids(slot_ids), ranks)
        for layer in self.lora_layers.values():
            layer.router = router
        try:
            yield
        finally:
            for layer in self.lora_layers.values():
                layer.router = None

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        slot_ids: Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        """The base model's forward with per-row adapters (``slot_ids`` None: base for all)."""
        with self.route(self._default_slots(input_ids, slot_ids)):
            return self.base_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        slot_ids: Tensor | None = None,
        **gen_kwargs: Any,
    ) -> Any:
        """``base_model.generate`` with per-row adapters; KV cache and expansion work as usual."""
        with self.route(self._default_slots(input_ids, slot_ids)):
            return self.base_model.generate(
                input_ids=input_ids, attention_mask=attention_mask, **gen_kwargs
            )

    def _default_slots(self, input_ids: Tensor, slot_ids: Tensor | None) -> Tensor:
        if slot_ids is None:
            return torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        if slot_ids.shape != input_ids.shape[:1]:
            raise RoutingError(
                f"slot_ids must have shape [{input_ids.shape[0]}], got {list(slot_ids.shape)}"
            )
        return slot_ids

    def _check_slot_ids(self, slot_ids: Tensor) -> Tensor:
        if slot_ids.dim() != 1 or slot_ids.dtype != torch.long:
            raise RoutingError("slot_ids must be a 1-D LongTensor")
        bad = set(slot_ids.unique().tolist()) - {0, *self._slots.values()}
        if bad:
            raise RoutingError(f"slot ids {sorted(bad)} hold no adapter")
        device = next(iter(self.lora_layers.values())).lora_A.device
        return slot_ids.to(device)

    # ---- PEFT-named weights ------------------------------------------------------------

    def adapter_views(
        self, name: str, of: Callable[[nn.Parameter], Tensor] | None = None
    ) -> dict[str, Tensor]:
        """PEFT key -> view of the adapter's block in each stacked tensor.

        ``of`` maps a stacked parameter to a same-shaped tensor (e.g. its optimiser moment);
        by default the parameter itself.
        """
        slot, config = self.slot_of(name), self._configs[name]
        of = of or (lambda p: p)
        r = config.rank
        views: dict[str, Tensor] = {}
        for path, layer in self.lora_layers.items():
            if _is_target(config, path):
                views[f"{PEFT_PREFIX}{path}.lora_A.weight"] = of(layer.lora_A)[slot, :r]
                views[f"{PEFT_PREFIX}{path}.lora_B.weight"] = of(layer.lora_B)[slot, :, :r]
        return views

    def adapter_state_dict(self, name: str) -> dict[str, Tensor]:
        """The adapter's weights with PEFT's saved key names (``...q_proj.lora_A.weight``)."""
        return {k: v.detach().clone() for k, v in self.adapter_views(name).items()}

    def load_adapter_state_dict(self, name: str, state_dict: Mapping[str, Tensor]) -> None:
        """Overwrite an adapter's weights; validates every key and shape before writing."""
        views = self.adapter_views(name)
        check_state_dict(views, state_dict, what=f"adapter {name!r}")
        with torch.no_grad():
            for key, view in views.items():
                view.copy_(state_dict[key])


def check_state_dict(
    expected: Mapping[str, Tensor], given: Mapping[str, Tensor], what: str
) -> None:
    """Raise AdapterError naming the first missing/unexpected key or wrong shape."""
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    if missing or unexpected:
        raise AdapterError(
            f"{what}: missing keys {missing[:3]}, unexpected keys {unexpected[:3]}"
            f" ({len(missing)} missing, {len(unexpected)} unexpected)"
        )
    for key, ref in expected.items():
        if tuple(given[key].shape) != tuple(ref.shape):
            raise AdapterError(
                f"{what}: {key} has shape {list(given[key].shape)}, expected {list(ref.shape)}"
            )


def _is_target(config: LoRAConfig, path: str) -> bool:
    return path.rsplit(".", 1)[-1] in config.target_modules


def _wrap_linears(
    model: nn.Module,
    target_modules: Sequence[str] | None,
    slots: int,
    max_rank: int,
    dtype: torch.dtype | None,
) -> dict[str, MultiLoRALinear]:
    """Replace matching ``nn.Linear`` modules in place; returns path -> wrapper.

    The output head is wrapped only when named explicitly (e.g. ``lm_head``): it is large,
    and tied to the input embeddings in many models.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    wanted = set(target_modules) if target_modules is not None else None
    if head is not None and wanted is not None and _name_of(model, head) in wanted:
        head = None
    found = [
        (path, mod)
        for path, mod in model.named_modules()
        if type(mod) is nn.Linear
        and mod is not head
        and (wanted is None or path.rsplit(".", 1)[-1] in wanted)
    ]
    absent = sorted((wanted or set()) - {p.rsplit(".", 1)[-1] for p, _ in found})
    if absent:
        raise UnknownTargetModuleError(f"no linear module named {absent} in the base model")
    wrapped: dict[str, MultiLoRALinear] = {}
    for path, linear in found:
        parent_path, _, attr = path.rpartition(".")
        layer = MultiLoRALinear(linear, slots, max_rank, dtype).train(linear.training)
        setattr(model.get_submodule(parent_path), attr, layer)
        wrapped[path] = layer
    return wrapped


def _name_of(model: nn.Module, module: nn.Module) -> str | None:
    """Last path component of ``module`` inside ``model``."""
    for path, mod in model.named_modules():
        if mod is module:
            return path.rsplit(".", 1)[-1]
    return None


def adaptable_module_names(base: nn.Module) -> list[str]:
    """The module names an adapter may target on ``base``: every linear projection, plus
    the output head when untied (LoRA on lm_head is what lets a tiny random model learn a
    task quickly; a tied head stays frozen)."""
    names = {
        path.rsplit(".", 1)[-1] for path, mod in base.named_modules() if type(mod) is nn.Linear
    }
    head = base.get_output_embeddings()
    if head is not None and head.weight is base.get_input_embeddings().weight:
        names.discard(next(p.rsplit(".", 1)[-1] for p, m in base.named_modules() if m is head))
    return sorted(names)


# (input ids, attention mask, positions, KV cache) -> (last position's logits, KV cache)
DecodeForward = Callable[[Tensor, Tensor, Tensor, Any], tuple[Tensor, Any]]


def decode_forward(model: MultiLoRAModel, device: torch.device | None = None) -> DecodeForward:
    """One decoding step of the base model, the torch rollout's forward; the caller has set
    the row routing. Inputs move to ``device`` (None: where they are)."""

    def forward(ids: Tensor, mask: Tensor, positions: Tensor, past: Any) -> tuple[Tensor, Any]:
        out = model.base_model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            past_key_values=past,
            use_cache=True,
            logits_to_keep=1,  # only the last position samples: no [rows, tokens, vocab]
        )
        return out.logits[:, -1], out.past_key_values  # stays on the device (sampling.py)

    return forward
