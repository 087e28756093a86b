"""The records of adapter paging (memory/paging.py): a paged-out adapter's page, at its
own rank, and the compact form of a client's accumulated gradient. Copies only: a page
holds exactly what the slot held, so an adapter paged out and in is bit for bit itself."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from loraplex_engine.lora.config import LoRAConfig
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.train.optim import AdamWSettings

SlotTensors = list[Tensor]  # one per optimizer.params entry: that parameter's [slot] block


class HoldsGrads(Protocol):
    """Who keeps an adapter's gradient accumulated across calls (a client model)."""

    grads: SlotTensors | None


@dataclass(frozen=True)
class CompactGrads:
    """An accumulated gradient at the adapter's own rank: per stacked parameter, its
    block ``[:r]`` (A) or ``[:, :r]`` (B), or None where the adapter does not train it;
    ``full`` keeps the whole padded block instead when anything outside was nonzero (a
    non-finite gradient spreads into the padding), so paging never changes a bit."""

    blocks: list[Tensor | None]
    full: bool


@dataclass(frozen=True)
class AdapterPage:
    """One paged-out adapter: all a slot held for it, on the host, at its own rank."""

    name: str
    config: LoRAConfig
    weights: dict[str, Tensor]  # PEFT key -> weight
    settings: AdamWSettings
    step: int
    exp_avg: dict[str, Tensor]  # PEFT key -> first moment
    exp_avg_sq: dict[str, Tensor]  # PEFT key -> second moment
    grads: CompactGrads | None  # accumulated, not yet stepped (client models)

    def nbytes(self) -> int:
        tensors = [*self.weights.values(), *self.exp_avg.values(), *self.exp_avg_sq.values()]
        if self.grads is not None:
            tensors += [t for t in self.grads.blocks if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class FreshPage:
    """A registered adapter that has not had a slot yet (it registered while every slot
    was taken): what makes its first one, its seeded initial weights and fresh AdamW
    state, when a tick first pages it in. Costs no copy and no host tensor."""

    name: str
    config: LoRAConfig
    seed: int | None
    settings: AdamWSettings


def _blocks(model: MultiLoRAModel, config: LoRAConfig) -> list[tuple[bool, bool]]:
    """Per optimizer.params entry (A then B of each layer): (targeted, is B)."""
    out = []
    for path in model.lora_layers:
        targeted = path.rsplit(".", 1)[-1] in config.target_modules
        out += [(targeted, False), (targeted, True)]
    return out


def compact_grads(model: MultiLoRAModel, config: LoRAConfig, grads: SlotTensors) -> CompactGrads:
    r = config.rank
    blocks: list[Tensor | None] = []
    for (targeted, is_b), g in zip(_blocks(model, config), grads, strict=True):
        blocks.append(None if not targeted else (g[:, :r] if is_b else g[:r]))
    rest = sum(float(g.abs().sum()) for g in grads) - sum(
        float(b.abs().sum()) for b in blocks if b is not None
    )
    if rest != 0.0 or any(not bool(torch.isfinite(g).all()) for g in grads):
        return CompactGrads([g.to("cpu", copy=True) for g in grads], full=True)
    return CompactGrads([None if b is None else b.to("cpu", copy=True) for b in blocks], False)


def expand_grads(
    model: MultiLoRAModel, config: LoRAConfig, grads: CompactGrads, like: Iterable[Tensor]
) -> SlotTensors:
    """The padded per-slot blocks again, on the stacked parameters' device."""
    out: SlotTensors = []
    for (_, is_b), block, p in zip(_blocks(model, config), grads.blocks, like, strict=True):
        whole = torch.zeros_like(p[0])
        if grads.full:
            whole.copy_(block)  # type: ignore[arg-type]
        elif block is not None:
            (whole[:, : block.shape[1]] if is_b else whole[: block.shape[0]]).copy_(block)
        out.append(whole)
    return out


def host_copy(views: dict[str, Tensor], pin: bool) -> dict[str, Tensor]:
    out = {}
    for key, view in views.items():
        host = torch.empty(view.shape, dtype=view.dtype, pin_memory=pin)
        out[key] = host.copy_(view.detach(), non_blocking=pin)
    return out
