"""The tick's client pass: every pending ``forward``/``forward_backward`` datum of every
client model in token-budgeted micro-batches, one routed forward (and one backward) per
micro-batch whatever the mix of adapters, then the pending optimiser steps.

Gradients: a client model's gradient accumulates across ``forward_backward`` calls until
its ``optim_step``, while the engine's own experiments zero and step the shared stacked
``.grad`` every tick (train/strategy.py). So a client gradient never stays in ``.grad``:
after the pass each model's slot of every stacked gradient is added to its own
accumulator (:class:`SlotGrads`) and ``.grad`` is cleared; an ``optim_step`` puts that
model's accumulator back into ``.grad`` and steps its slot alone. Neither side can
then clear or step the other's gradient (tests/engine/clients/test_client_training.py).

Log-prob at position ``i`` is ``log p(target_tokens[i] | input_ids[:i+1])`` at
temperature 1: the policy forward runs over ``input_ids`` and the head scores the given
targets (any tokens, not only the shifted inputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from loraplex_engine.clients.inputs import Datum
from loraplex_engine.lora.gradient_checkpointing import gradient_checkpointing as checkpointed
from loraplex_engine.train.algorithms import token_logprobs
from loraplex_engine.train.algorithms.tinker_losses import TokenLoss
from loraplex_engine.train.chunked_logprobs import HiddenStatesForward, chunked_token_logprobs
from loraplex_engine.train.optim import AdamWSettings, PerAdapterAdamW
from loraplex_engine.train.rows import RoutedForward, pack_micro_batches
from loraplex_engine.training_service import ForwardOutput

SlotGrads = list[torch.Tensor]  # one per optimizer.params entry: that param's [slot] grad


@dataclass
class TrainCall:
    """One ``forward`` or ``forward_backward`` call of a model in its slot."""

    slot: int
    data: list[Datum]
    loss: TokenLoss
    backward: bool
    outputs: list[dict[str, np.ndarray]] = field(default_factory=list)

    def output(self) -> ForwardOutput:
        total = float(sum(o["elementwise_loss"].sum(dtype=np.float64) for o in self.outputs))
        tokens = sum(len(o["logprobs"]) for o in self.outputs)
        return ForwardOutput(self.outputs, {"loss:sum": total, "num_tokens:sum": float(tokens)})


@dataclass(frozen=True)
class _Item:
    call: int
    datum: int
    length: int


def client_pass(
    forward: RoutedForward | HiddenStatesForward,
    calls: Sequence[TrainCall],
    pad_id: int,
    token_budget: int,
    gradient_checkpointing: bool = False,
) -> None:
    """Run every call's data (outputs filled in, gradients into ``.grad``): one forward
    per micro-batch for all models, backward over the ``forward_backward`` rows' summed
    loss. The caller clears ``.grad`` before and takes the slots' gradients after."""
    items = [_Item(c, d, x.length) for c, call in enumerate(calls) for d, x in enumerate(call.data)]
    for call in calls:
        call.outputs = [{} for _ in call.data]
    use_ckpt = gradient_checkpointing and isinstance(forward, HiddenStatesForward)
    with checkpointed(forward.model) if use_ckpt else nullcontext():  # type: ignore[union-attr]
        for batch in pack_micro_batches(items, token_budget):
            _micro_batch(forward, calls, [items[i] for i in batch], pad_id)


def _micro_batch(
    forward: RoutedForward | HiddenStatesForward,
    calls: Sequence[TrainCall],
    items: list[_Item],
    pad_id: int,
) -> None:
    width = max(it.length for it in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    targets = torch.zeros((len(items), width), dtype=torch.long)
    attn = torch.zeros((len(items), width), dtype=torch.long)
    scored: list[int] = []
    for row, it in enumerate(items):
        datum = calls[it.call].data[it.datum]
        ids[row, : it.length] = torch.tensor(datum.input_ids)
        targets[row, : it.length] = datum.targets
        attn[row, : it.length] = 1
        scored += range(row * width, row * width + it.length)
    slots = torch.tensor([calls[it.call].slot for it in items])
    grad = any(calls[it.call].backward for it in items)
    with torch.enable_grad() if grad else torch.no_grad():
        logprobs = _logprobs(forward, ids, attn, slots, targets, torch.tensor(scored))
        total = None
        for row, it in enumerate(items):
            call = calls[it.call]
            datum = call.data[it.datum]
            lp = logprobs[row, : it.length]
            loss = call.loss(datum.loss_inputs(lp if call.backward else lp.detach()))
            call.outputs[it.datum] = {
                "logprobs": lp.detach().float().cpu().numpy(),
                "elementwise_loss": loss.detach().float().cpu().numpy(),
            }
            if call.backward:
                total = loss.sum() if total is None else total + loss.sum()
        if total is not None and total.requires_grad:
            total.backward()


def _logprobs(
    forward: RoutedForward | HiddenStatesForward,
    ids: torch.Tensor,
    attn: torch.Tensor,
    slots: torch.Tensor,
    targets: torch.Tensor,
    scored: torch.Tensor,
) -> torch.Tensor:
    if isinstance(forward, HiddenStatesForward):
        hidden = forward(ids, attn, slots)
        dev = hidden.device
        return chunked_token_logprobs(
            hidden,
            forward.head,
            targets.to(dev),
            torch.ones(ids.shape[0], device=dev),
            scored.to(dev),
            forward.chunk_tokens,
            slots.to(dev),
        )
    logits = forward(ids, attn, slots)
    return token_logprobs(logits, targets.to(logits.device))


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
