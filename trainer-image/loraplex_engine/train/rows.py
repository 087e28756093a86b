"""Training rows and their micro-batches: a prompt and its sampled completion, packed
into token-budgeted micro-batches (with shared prompt prefixes where rows share one),
collated to tensors, and their per-token log-probs under the policy. The update
(train/step.py) and a sharded base's lockstep (parallel/sharding.py) both build on these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from loraplex_engine.train.algorithms import token_logprobs
from loraplex_engine.train.chunked_logprobs import HiddenStatesForward, chunked_token_logprobs
from loraplex_engine.train.shared_prefix import SharedForward

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
    # Prompt group within this experiment's step: rows of one experiment with the same
    # group have identical ``prompt_ids`` (and the experiment's slot), so they may share
    # one prefix computation. None: the row shares with no other.
    group: int | None = None
    # The sampler's log-probs when ``old_logprobs`` were recomputed by the trainer
    # (score_rows); None: ``old_logprobs`` are the sampler's own (the torch rollout).
    behaviour_logprobs: list[float] | None = None
    # Per completion token, 1 = the policy's (trained), 0 = an environment's observation
    # (masked out of the loss, its log-probs placeholders). None: every token is trained.
    mask: list[int] | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def prefix_key(self) -> tuple[str, int] | None:
        """Rows with equal keys share a prompt prefix; None when this row cannot.

        The prefix is the prompt minus its last token (whose logits predict the first
        completion token), so a one-token prompt has nothing to share.
        """
        if self.group is None or len(self.prompt_ids) < 2:
            return None
        return (self.experiment, self.group)


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


def prefix_groups(rows: Sequence[TrainRow], indices: Sequence[int]) -> list[list[int]]:
    """``indices`` grouped by shared prefix (first-seen order); a row with no key alone.

    Raises ValueError if rows of one key differ in prompt or slot (a caller bug: sharing
    them would train on the wrong prompt).
    """
    groups: dict[object, list[int]] = {}
    for i in indices:
        key = rows[i].prefix_key
        groups.setdefault(("row", i) if key is None else key, []).append(i)
    for members in groups.values():
        first = rows[members[0]]
        for i in members[1:]:
            if rows[i].prompt_ids != first.prompt_ids or rows[i].slot != first.slot:
                raise ValueError(
                    f"rows of prompt group {first.prefix_key} differ in prompt or slot"
                )
    return list(groups.values())


def _shared_cost(rows: Sequence[TrainRow], units: Sequence[Sequence[int]]) -> int:
    """Padded tokens of a shared micro-batch: each prefix once, then every row's completion."""
    prefix = max(len(rows[u[0]].prompt_ids) - 1 for u in units)
    completion = max(len(rows[i].completion_ids) for u in units for i in u)
    return len(units) * prefix + sum(len(u) for u in units) * completion


def pack_micro_batches_shared(rows: Sequence[TrainRow], token_budget: int) -> list[list[list[int]]]:
    """Micro-batches of prefix groups (lists of row indices) for the shared forward.

    A group stays in one micro-batch when it fits the budget alone (its prefix counted
    once); a larger one is split into pieces that each fit (each piece recomputes the
    prefix: correct, just a smaller saving), at least one row per piece. Groups are
    sorted by their longest row, so padding stays small, and tenants mix freely. Rows
    that cannot share (one-token prompts) are not packed here: see ``fused_backward``.
    """
    units = prefix_groups(rows, [i for i, r in enumerate(rows) if len(r.prompt_ids) >= 2])
    pieces: list[list[int]] = []
    for unit in sorted(units, key=lambda u: (max(rows[i].length for i in u), u[0])):
        unit = sorted(unit, key=lambda i: len(rows[i].completion_ids))
        if _shared_cost(rows, [unit]) <= token_budget:
            pieces.append(unit)
            continue
        prefix = len(rows[unit[0]].prompt_ids) - 1
        width = max(len(rows[i].completion_ids) for i in unit)
        size = max(1, (token_budget - prefix) // max(width, 1))
        pieces += [unit[k : k + size] for k in range(0, len(unit), size)]
    batches: list[list[list[int]]] = []
    current: list[list[int]] = []
    for piece in pieces:
        if current and _shared_cost(rows, [*current, piece]) > token_budget:
            batches.append(current)
            current = []
        current.append(piece)
    if current:
        batches.append(current)
    return batches


def collate_rows(
    rows: Sequence[TrainRow], pad_id: int, width: int | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad rows (to ``width``, default the longest); ``targets[t]`` is the token
    predicted at position ``t``."""
    width = max([*(r.length for r in rows), width or 0])
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    completion_mask = torch.zeros((len(rows), width - 1))
    old = torch.zeros((len(rows), width - 1))
    behaviour = torch.zeros((len(rows), width - 1))
    scored: list[int] = []  # flat positions in [rows, width - 1] whose log-prob is used
    for i, row in enumerate(rows):
        seq = row.prompt_ids + row.completion_ids
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        start = len(row.prompt_ids) - 1  # logits at t predict token t+1
        end = start + len(row.completion_ids)
        completion_mask[i, start:end] = _mask(row)
        old[i, start:end] = torch.tensor(row.old_logprobs)
        behaviour[i, start:end] = torch.tensor(_behaviour(row))
        scored += range(i * (width - 1) + start, i * (width - 1) + end)
    return {
        "ids": ids,
        "attn": attn,
        "mask": completion_mask,
        "old": old,
        "behaviour": behaviour,
        "slots": torch.tensor([r.slot for r in rows]),
        "adv": torch.tensor([r.advantage for r in rows]),
        "temp": torch.tensor([max(r.temperature, 1e-6) for r in rows]),
        "scored": torch.tensor(scored, dtype=torch.long),
    }


def collate_shared(groups: Sequence[Sequence[TrainRow]], pad_id: int) -> dict[str, torch.Tensor]:
    """Prefixes (prompt minus its last token) right-padded, one per group; each row's
    input is the prompt's last token + its completion but the last token, so logits at
    ``t`` predict completion token ``t`` and every target is a completion token."""
    rows = [r for g in groups for r in g]
    prefix_width = max(len(g[0].prompt_ids) - 1 for g in groups)
    width = max(1, max(len(r.completion_ids) for r in rows))
    prefix_ids = torch.full((len(groups), prefix_width), pad_id, dtype=torch.long)
    prefix_attn = torch.zeros((len(groups), prefix_width), dtype=torch.long)
    row_group = torch.tensor([g for g, members in enumerate(groups) for _ in members])
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    targets = torch.full((len(rows), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width))
    old = torch.zeros((len(rows), width))
    behaviour = torch.zeros((len(rows), width))
    for g, members in enumerate(groups):
        prefix = members[0].prompt_ids[:-1]
        prefix_ids[g, : len(prefix)] = torch.tensor(prefix)
        prefix_attn[g, : len(prefix)] = 1
    for i, row in enumerate(rows):
        n = len(row.completion_ids)
        if n:
            ids[i, :n] = torch.tensor([row.prompt_ids[-1], *row.completion_ids[:-1]])
            targets[i, :n] = torch.tensor(row.completion_ids)
            old[i, :n] = torch.tensor(row.old_logprobs)
            behaviour[i, :n] = torch.tensor(_behaviour(row))
        attn[i, :n] = 1
        if n:
            mask[i, :n] = _mask(row)
        positions[i] = torch.arange(len(row.prompt_ids) - 1, len(row.prompt_ids) - 1 + width)
    return {
        "prefix_ids": prefix_ids,
        "prefix_attn": prefix_attn,
        "prefix_slots": torch.tensor([g[0].slot for g in groups]),
        "row_group": row_group,
        "ids": ids,
        "attn": torch.cat([prefix_attn[row_group], attn], dim=1),
        "positions": positions,
        "targets": targets,
        "mask": mask,
        "old": old,
        "behaviour": behaviour,
        "slots": torch.tensor([r.slot for r in rows]),
        "adv": torch.tensor([r.advantage for r in rows]),
        "temp": torch.tensor([max(r.temperature, 1e-6) for r in rows]),
    }


def _mask(row: TrainRow) -> torch.Tensor | float:
    return 1.0 if row.mask is None else torch.tensor(row.mask, dtype=torch.float32)


def _behaviour(row: TrainRow) -> list[float]:
    return row.old_logprobs if row.behaviour_logprobs is None else row.behaviour_logprobs


def shared_logprobs(forward: SharedForward, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = forward(
        batch["prefix_ids"],
        batch["prefix_attn"],
        batch["prefix_slots"],
        batch["row_group"],
        batch["ids"],
        batch["attn"],
        batch["slots"],
        batch["positions"],
    )
    dev = logits.device
    logits = logits / batch["temp"].to(dev)[:, None, None]
    return token_logprobs(logits, batch["targets"].to(dev))


def row_logprobs(
    forward: RoutedForward | HiddenStatesForward, batch: dict[str, torch.Tensor]
) -> torch.Tensor:
    if isinstance(forward, HiddenStatesForward):
        hidden = forward(batch["ids"], batch["attn"], batch["slots"])[:, :-1]
        dev = hidden.device
        return chunked_token_logprobs(
            hidden,
            forward.head,
            batch["ids"][:, 1:].to(dev),
            1.0 / batch["temp"].to(dev),
            batch["scored"].to(dev),
            forward.chunk_tokens,
            batch["slots"].to(dev),
        )
    logits = forward(batch["ids"], batch["attn"], batch["slots"])[:, :-1]
    dev = logits.device  # the model's device: no host round trip of [B, T, V] logits
    # Score under the same temperature the rollout sampled with, so ratio = 1 on-policy.
    logits = logits / batch["temp"].to(dev)[:, None, None]
    return token_logprobs(logits, batch["ids"][:, 1:].to(dev))


def count_rows(rows: Sequence[TrainRow]) -> dict[str, int]:
    """Rows per experiment: the denominators of the loss weights."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.experiment] = counts.get(row.experiment, 0) + 1
    return counts


@torch.no_grad()
def dummy_forward(forward: RoutedForward | HiddenStatesForward, pad_id: int) -> None:
    """A scoring micro-batch's collectives with no effect (train/step.py's score_rows under a
    sharded base): :func:`dummy_backward`'s row, forward only."""
    row = TrainRow("", 0, [pad_id], [pad_id], [0.0], 0.0, 1.0)
    row_logprobs(forward, collate_rows([row], pad_id))


def dummy_backward(
    forward: RoutedForward | HiddenStatesForward, pad_id: int, with_ref: bool
) -> None:
    """A micro-batch's collectives with no effect: one base-only (slot 0) row of two pad
    tokens, its forward (and reference forward), and a backward of zero (the embeddings'
    output requires grad under a sharded base, so the backward runs every layer)."""
    row = TrainRow("", 0, [pad_id], [pad_id], [0.0], 0.0, 1.0)
    batch = collate_rows([row], pad_id)
    logprobs = row_logprobs(forward, batch)
    if with_ref:
        with torch.no_grad():
            row_logprobs(forward, batch)
    (logprobs.sum() * 0.0).backward()
