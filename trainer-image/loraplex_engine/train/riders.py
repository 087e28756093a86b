"""Client calls' data riding the update's pass (train/step.py): the one fused step.

A client model's ``forward``/``forward_backward`` datum (clients/) is a row like an
experiment's: a slot, a length, one routed forward. What differs is its targets (any
tokens, scored at every position, temperature 1, not the shifted inputs) and its loss
(Tinker's, a sum over its tokens: train/algorithms/tinker_losses.py). So both kinds go
into one micro-batch plan (:class:`PassItem`, packed by length), each micro-batch runs
one forward over all its rows, each kind's log-probs come off that forward's hidden
states (or logits) with its own targets, every loss is its own, and one backward runs
over their sum. Each adapter's rows depend only on its slot, so every gradient is the
one it would get alone (up to the float rounding of other padding widths).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from loraplex_engine.spec.training_service import ForwardOutput
from loraplex_engine.train.algorithms import token_logprobs
from loraplex_engine.train.algorithms.tinker_losses import TokenLoss
from loraplex_engine.train.chunked_logprobs import HiddenStatesForward, chunked_token_logprobs
from loraplex_engine.train.rows import RoutedForward

if TYPE_CHECKING:
    from loraplex_engine.clients.inputs import Datum


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
class PassItem:
    """One row of the pass's plan: an experiment's row (``row``) or a call's datum."""

    length: int
    row: int | None = None  # index into the update's rows
    call: int | None = None  # index into the riding calls
    datum: int = 0


def rider_items(calls: Sequence[TrainCall]) -> list[PassItem]:
    """Every datum of every call, as items of the pass's plan."""
    return [
        PassItem(d.length, call=c, datum=i)
        for c, call in enumerate(calls)
        for i, d in enumerate(call.data)
    ]


def start_outputs(calls: Sequence[TrainCall]) -> None:
    for call in calls:
        call.outputs = [{} for _ in call.data]


@dataclass
class RiderBatch:
    """The riding data of one micro-batch, collated to the micro-batch's width."""

    items: list[PassItem]
    ids: torch.Tensor
    attn: torch.Tensor
    targets: torch.Tensor
    slots: torch.Tensor
    scored: torch.Tensor
    logprobs: torch.Tensor | None = None  # [rows, width], set by the joint forward


def collate_riders(
    calls: Sequence[TrainCall], items: list[PassItem], pad_id: int, width: int
) -> RiderBatch:
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    targets = torch.zeros((len(items), width), dtype=torch.long)
    attn = torch.zeros((len(items), width), dtype=torch.long)
    scored: list[int] = []
    for row, it in enumerate(items):
        datum = calls[it.call or 0].data[it.datum]
        ids[row, : it.length] = torch.tensor(datum.input_ids)
        targets[row, : it.length] = datum.targets
        attn[row, : it.length] = 1
        scored += range(row * width, row * width + it.length)
    slots = torch.tensor([calls[it.call or 0].slot for it in items])
    return RiderBatch(items, ids, attn, targets, slots, torch.tensor(scored, dtype=torch.long))


def joint_logprobs(
    forward: RoutedForward | HiddenStatesForward,
    exp: dict[str, torch.Tensor] | None,
    riders: RiderBatch,
) -> torch.Tensor | None:
    """One forward over the experiments' rows (``exp``, collated at the riders' width;
    None: none) and the riders; sets ``riders.logprobs`` and returns the experiments'
    log-probs as train/rows.row_logprobs would."""
    n = 0 if exp is None else exp["ids"].shape[0]
    ids = riders.ids if exp is None else torch.cat([exp["ids"], riders.ids])
    attn = riders.attn if exp is None else torch.cat([exp["attn"], riders.attn])
    slots = riders.slots if exp is None else torch.cat([exp["slots"], riders.slots])
    out = forward(ids, attn, slots)
    dev = out.device
    mine = out[n:]
    if isinstance(forward, HiddenStatesForward):
        ones = torch.ones(mine.shape[0], device=dev)
        riders.logprobs = chunked_token_logprobs(
            mine, forward.head, riders.targets.to(dev), ones, riders.scored.to(dev),
            forward.chunk_tokens, riders.slots.to(dev),
        )  # fmt: skip
    else:
        riders.logprobs = token_logprobs(mine, riders.targets.to(dev))
    if exp is None:
        return None
    theirs = out[:n, :-1]
    if isinstance(forward, HiddenStatesForward):
        return chunked_token_logprobs(
            theirs, forward.head, exp["ids"][:, 1:].to(dev), 1.0 / exp["temp"].to(dev),
            exp["scored"].to(dev), forward.chunk_tokens, exp["slots"].to(dev),
        )  # fmt: skip
    theirs = theirs / exp["temp"].to(dev)[:, None, None]
    return token_logprobs(theirs, exp["ids"][:, 1:].to(dev))


def rider_loss(calls: Sequence[TrainCall], riders: RiderBatch) -> torch.Tensor | None:
    """Each datum's outputs filled in; the summed loss of the ``forward_backward`` data
    (None: none in this micro-batch)."""
    assert riders.logprobs is not None, "joint_logprobs runs first"
    total = None
    for row, it in enumerate(riders.items):
        call = calls[it.call or 0]
        datum = call.data[it.datum]
        lp = riders.logprobs[row, : it.length]
        loss = call.loss(datum.loss_inputs(lp if call.backward else lp.detach()))
        call.outputs[it.datum] = {
            "logprobs": lp.detach().float().cpu().numpy(),
            "elementwise_loss": loss.detach().float().cpu().numpy(),
        }
        if call.backward:
            total = loss.sum() if total is None else total + loss.sum()
    return total
