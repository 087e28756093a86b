"""The client models' gradients and optimiser steps. Their ``forward``/``forward_backward``
data runs in the tick's one pass with the experiments' rows (train/riders.py).

Gradients: a client model's gradient accumulates across ``forward_backward`` calls until
its ``optim_step``, while the engine's own experiments zero and step the shared stacked
``.grad`` every tick (train/strategy.py). So a client gradient never stays in ``.grad``:
after the pass each model's slot of every stacked gradient is added to its own
accumulator (:class:`SlotGrads`) and ``.grad`` is cleared; an ``optim_step`` puts that
model's accumulator back into ``.grad`` and steps its slot alone. Neither side can
then clear or step the other's gradient (tests/engine/clients/test_client_training.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loraplex_engine.train.optim import AdamWSettings, PerAdapterAdamW

SlotGrads = list[torch.Tensor]  # one per optimizer.params entry: that param's [slot] grad


def take_slot_grads(optimizer: PerAdapterAdamW, slot: int, into: SlotGrads | None) -> SlotGrads:
    """``into`` plus slot ``slot``'s share of every stacked gradient (a copy)."""
    mine = [
        p.grad[slot].clone() if p.grad is not None else torch.zeros_like(p.data[slot])
        for p in optimizer.params
    ]
    if into is None:
        return mine
    for acc, g in zip(into, mine, strict=True):
        acc.add_(g)
    return into


@dataclass(frozen=True)
class StepCall:
    name: str  # the adapter's name in the model and optimiser
    slot: int
    grads: SlotGrads | None  # accumulated since its last step (None: none)
    settings: AdamWSettings


def optim_steps(
    optimizer: PerAdapterAdamW, steps: Sequence[StepCall]
) -> dict[str, dict[str, float]]:
    """Step each model's slot with its own accumulated gradient and settings; a model
    whose gradient is not finite is not stepped (its metrics say so). ``.grad`` is left
    cleared."""
    if not steps:
        return {}
    optimizer.zero_grad()
    for i, p in enumerate(optimizer.params):
        grad = torch.zeros_like(p)
        for s in steps:
            if s.grads is not None:
                grad[s.slot] = s.grads[i]
        p.grad = grad
    norms = optimizer.grad_norms().tolist()
    out: dict[str, dict[str, float]] = {}
    ok = []
    for s in steps:
        norm = norms[s.slot]
        out[s.name] = {"grad_norm:mean": norm, "learning_rate:mean": s.settings.lr}
        if np.isfinite(norm):
            optimizer.configure(s.name, s.settings)
            ok.append(s.slot)
        else:
            out[s.name]["skipped:sum"] = 1.0
    try:
        optimizer.step(ok)
    finally:
        optimizer.zero_grad()
    return out
