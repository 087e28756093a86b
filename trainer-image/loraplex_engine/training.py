"""One RL policy update for many adapters: fused (one forward/backward over all
tenants' rows, packed into token-budgeted micro-batches) or time-sliced (one adapter
at a time, the published baseline).

Loss normalisation: every row carries ``weight = 1 / rows of its experiment``, so the
summed loss over any packing of rows into micro-batches is the sum over experiments
of each experiment's mean sequence loss. Rows of one experiment depend only on its
adapter, hence each adapter's gradient equals what it would get trained alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from loraplex_engine.algorithms import Algorithm, token_logprobs

# (input_ids [B,T], attention_mask [B,T], slot_ids [B]) -> logits [B,T,V]
RoutedForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class TrainRow:
    """A prompt + sampled completion, ready for the policy-gradient step."""

    experiment: str
    slot: int
    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]
    advantage: float
    temperature: float

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class ExperimentUpdate:
    """Per-experiment settings the loss needs."""

    algorithm: Algorithm
    clip: float
    kl_coef: float


@dataclass
class TrainStats:
    loss: dict[str, float] = field(default_factory=dict)
    kl: dict[str, float] = field(default_factory=dict)
    clip_fraction: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    micro_batches: int = 0


def pack_micro_batches(rows: Sequence[TrainRow], token_budget: int) -> list[list[int]]:
    """Group row indices into micro-batches whose padded size stays within budget.

    Rows are sorted by length so padding stays small; tenants mix freely, which is
    what makes small per-tenant batches cheap, while large ones are split (gradient
    accumulation keeps the update identical).
    """
    order = sorted(range(len(rows)), key=lambda i: rows[i].length)
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        width = rows[index].length  # the longest so far: rows are sorted
        if current and width * (len(current) + 1) > token_budget:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def _collate(rows: Sequence[TrainRow], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows; ``targets[t]`` is the token predicted at position ``t``."""
    width = max(r.length for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    completion_mask = torch.zeros((len(rows), width - 1))
    old = torch.zeros((len(rows), width - 1))
    for i, row in enumerate(rows):
        seq = row.prompt_ids + row.completion_ids
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        start = len(row.prompt_ids) - 1  # logits at t predict token t+1
        end = start + len(row.completion_ids)
        completion_mask[i, start:end] = 1
        old[i, start:end] = torch.tensor(row.old_logprobs)
    return {
        "ids": ids,
        "attn": attn,
        "mask": completion_mask,
        "old": old,
        "slots": torch.tensor([r.slot for r in rows]),
        "adv": torch.tensor([r.advantage for r in rows]),
        "temp": torch.tensor([max(r.temperature, 1e-6) for r in rows]),
    }


def _logprobs(forward: RoutedForward, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = forward(batch["ids"], batch["attn"], batch["slots"])[:, :-1]
    dev = logits.device  # the model's device: no host round trip of [B, T, V] logits
    # Score under the same temperature the rollout sampled with, so ratio = 1 on-policy.
    logits = logits / batch["temp"].to(dev)[:, None, None]
    return token_logprobs(logits, batch["ids"][:, 1:].to(dev))


def _micro_batch_loss(
    forward: RoutedForward,
    rows: Sequence[TrainRow],
    batch: dict[str, torch.Tensor],
    updates: dict[str, ExperimentUpdate],
    weights: dict[str, float],
    stats: TrainStats,
) -> torch.Tensor:
    logprobs = _logprobs(forward, batch)
    batch = {k: v.to(logprobs.device) for k, v in batch.items()}
    ref = None
    if any(updates[r.experiment].kl_coef > 0 for r in rows):
        with torch.no_grad():  # slot 0 = the frozen base: the KL reference for free
            ref = _logprobs(forward, {**batch, "slots": torch.zeros_like(batch["slots"])})
    total = logprobs.new_zeros(())
    for exp in dict.fromkeys(r.experiment for r in rows):
        index = torch.tensor(
            [i for i, r in enumerate(rows) if r.experiment == exp], device=logprobs.device
        )
        upd = updates[exp]
        out = upd.algorithm.loss(
            logprobs[index],
            batch["old"][index],
            None if ref is None else ref[index],
            batch["adv"][index],
            batch["mask"][index],
            clip=upd.clip,
            kl_coef=upd.kl_coef,
        )
        total = total + out.seq_loss.sum() * weights[exp]
        stats.loss[exp] = (
            stats.loss.get(exp, 0.0) + float(out.seq_loss.detach().sum()) * weights[exp]
        )
        stats.kl[exp] = float(out.kl)
        stats.clip_fraction[exp] = float(out.clip_fraction)
        stats.tokens[exp] = stats.tokens.get(exp, 0) + int(batch["attn"][index].sum())
    return total


def fused_backward(
    forward: RoutedForward,
    rows: Sequence[TrainRow],
    updates: dict[str, ExperimentUpdate],
    pad_id: int,
    token_budget: int,
) -> TrainStats:
    """Accumulate every adapter's gradient over all rows; the caller steps the optimiser."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.experiment] = counts.get(row.experiment, 0) + 1
    weights = {exp: 1.0 / n for exp, n in counts.items()}
    stats = TrainStats()
    for indices in pack_micro_batches(rows, token_budget):
        # Tenants contiguous inside the micro-batch: the LoRA layers then add the delta
        # in place instead of gathering rows and scattering them back (lora.Routing).
        chunk = sorted((rows[i] for i in indices), key=lambda r: r.slot)
        loss = _micro_batch_loss(forward, chunk, _collate(chunk, pad_id), updates, weights, stats)
        loss.backward()
        stats.micro_batches += 1
    return stats
