"""The maths of one RL policy update for many adapters: one forward/backward over the
rows given, packed into token-budgeted micro-batches. Who is in one call (every tenant,
or one adapter at a time) is the training strategy's choice (training_strategy.py).

Loss normalisation: every row carries ``weight = 1 / rows of its experiment``, so the
summed loss over any packing of rows into micro-batches is the sum over experiments
of each experiment's mean sequence loss. Rows of one experiment depend only on its
adapter, hence each adapter's gradient equals what it would get trained alone.

Shared prompt prefixes: GRPO trains ``groupSize`` completions of one prompt. Rather than
run every row as prompt + completion, a micro-batch runs each group's prompt (all but its
last token) once, with gradient, expands the resulting KV cache to the group's rows and
runs the completions on top of it (``SharedForward``, shared_prefix.py, which also says
which models it is exact for). Backward sums the rows' gradients
into the shared prefix, so every adapter's gradient is the unshared one up to float
rounding (tested against the unshared path on Llama and Qwen2).

Old log-probs: when the sampler is not this model (vLLM), ``score_rows`` recomputes each
row's old log-probs with the same micro-batches and forward the update then runs, without
gradient, and the sampler's stay on the row as ``behaviour_logprobs`` (for TIS and the
off-policy gap, algorithms/grpo.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loraplex_engine.algorithms import LossInputs, PolicyLoss, token_logprobs
from loraplex_engine.checkpointing import gradient_checkpointing as checkpointed
from loraplex_engine.chunked_logprobs import HiddenStatesForward, chunked_token_logprobs
from loraplex_engine.shared_prefix import SharedForward

if TYPE_CHECKING:
    from loraplex_engine.sharding import Lockstep

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


@dataclass
class TrainStats:
    loss: dict[str, float] = field(default_factory=dict)
    kl: dict[str, float] = field(default_factory=dict)
    clip_fraction: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)  # logical: prompt + completion per row
    micro_batches: int = 0
    shared_micro_batches: int = 0  # of which ran with shared prompt prefixes
    computed_tokens: int = 0  # real tokens through the policy forward (a shared prefix once)


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


def collate_rows(rows: Sequence[TrainRow], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows; ``targets[t]`` is the token predicted at position ``t``."""
    width = max(r.length for r in rows)
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
        completion_mask[i, start:end] = 1
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


def _collate_shared(groups: Sequence[Sequence[TrainRow]], pad_id: int) -> dict[str, torch.Tensor]:
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
        mask[i, :n] = 1
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


def _behaviour(row: TrainRow) -> list[float]:
    return row.old_logprobs if row.behaviour_logprobs is None else row.behaviour_logprobs


def _shared_logprobs(forward: SharedForward, batch: dict[str, torch.Tensor]) -> torch.Tensor:
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


def _micro_batch_loss(
    logprobs_of: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    rows: Sequence[TrainRow],
    batch: dict[str, torch.Tensor],
    losses: dict[str, PolicyLoss],
    weights: dict[str, float],
    stats: TrainStats,
    with_ref: bool | None = None,
) -> torch.Tensor:
    """``with_ref``: run the KL reference forward (None: when some row has a KL term)."""
    logprobs = logprobs_of(batch)
    batch = {k: v.to(logprobs.device) for k, v in batch.items()}
    ref = None
    if with_ref is None:
        with_ref = _needs_ref(rows, losses)
    if with_ref:
        with torch.no_grad():  # slot 0 = the frozen base: the KL reference for free
            base = {k: torch.zeros_like(batch[k]) for k in ("slots", "prefix_slots") if k in batch}
            ref = logprobs_of({**batch, **base})
    total = logprobs.new_zeros(())
    for exp in dict.fromkeys(r.experiment for r in rows):
        index = torch.tensor(
            [i for i, r in enumerate(rows) if r.experiment == exp], device=logprobs.device
        )
        out = losses[exp](
            LossInputs(
                logprobs[index],
                batch["old"][index],
                batch["adv"][index],
                batch["mask"][index],
                None if ref is None else ref[index],
                batch["behaviour"][index],
            )
        )
        total = total + out.seq_loss.sum() * weights[exp]
        stats.loss[exp] = (
            stats.loss.get(exp, 0.0) + float(out.seq_loss.detach().sum()) * weights[exp]
        )
        stats.kl[exp] = float(out.kl)
        stats.clip_fraction[exp] = float(out.clip_fraction)
        stats.tokens[exp] = stats.tokens.get(exp, 0) + sum(
            r.length for r in rows if r.experiment == exp
        )
    return total


def plan_micro_batches(
    rows: Sequence[TrainRow], token_budget: int, share_prefix: bool
) -> list[tuple[list[list[int]], bool]]:
    """Micro-batches as (prefix groups of row indices, run with a shared prefix?).

    Unshared (every group one row, packed by ``pack_micro_batches`` as before) are: all
    rows when ``share_prefix`` is off or no two rows share a prompt group (``groupSize``
    1); rows with a one-token prompt; and micro-batches whose groups all hold a single
    row (nothing to share, so one forward instead of two).
    """
    keys = [r.prefix_key for r in rows if r.prefix_key is not None]
    if not share_prefix or len(set(keys)) == len(keys):
        return [([[i] for i in b], False) for b in pack_micro_batches(rows, token_budget)]
    plan: list[tuple[list[list[int]], bool]] = []
    loose = [i for i, r in enumerate(rows) if len(r.prompt_ids) < 2]
    for groups in pack_micro_batches_shared(rows, token_budget):
        if any(len(g) > 1 for g in groups):
            plan.append((groups, True))
        else:
            loose += [g[0] for g in groups]
    for b in pack_micro_batches([rows[i] for i in loose], token_budget):
        plan.append(([[loose[j]] for j in b], False))
    return plan


def fused_backward(
    forward: RoutedForward | HiddenStatesForward,
    rows: Sequence[TrainRow],
    losses: dict[str, PolicyLoss],
    pad_id: int,
    token_budget: int,
    shared_forward: SharedForward | None = None,
    gradient_checkpointing: bool = False,
    row_counts: Mapping[str, int] | None = None,
    lockstep: Lockstep | None = None,
) -> TrainStats:
    """Accumulate every adapter's gradient over all rows; the caller steps the optimiser.

    With ``shared_forward``, the rows of one prompt group compute their prompt once per
    micro-batch (``plan_micro_batches`` says which micro-batches do). A
    ``HiddenStatesForward`` computes the log-probs chunk by chunk (chunked_logprobs.py).
    ``gradient_checkpointing`` recomputes each decoder layer in the backward under the
    same routing (checkpointing.py); it needs a ``HiddenStatesForward`` (for its model)
    and trains unshared, since a checkpointed layer keeps no KV cache to share.
    ``row_counts`` (rows per experiment; default: counted in ``rows``) are the loss
    weights' denominators: data parallelism (data_parallel.py) passes the whole tick's,
    so each rank's share of the rows gives its share of the one-rank gradient.
    ``lockstep`` (a sharded base, sharding.py): every rank runs as many micro-batches as
    the busiest one (dummy ones, weighing nothing, when out of rows), each with the KL
    reference forward if any rank's needs it, so their collectives pair up; it needs
    unshared micro-batches (one forward each).
    """
    if lockstep is not None and shared_forward is not None and not gradient_checkpointing:
        raise ValueError("lockstep training needs unshared micro-batches (shared_forward None)")
    counts = dict(row_counts) if row_counts is not None else count_rows(rows)
    missing = sorted({r.experiment for r in rows} - set(counts))
    if missing:
        raise ValueError(f"row_counts has no count for experiments {missing}")
    weights = {exp: 1.0 / n for exp, n in counts.items()}
    run = functools.partial(
        _fused_backward, forward, rows, losses, pad_id, token_budget, lockstep=lockstep
    )
    if not gradient_checkpointing:
        return run(shared_forward, weights)
    if not isinstance(forward, HiddenStatesForward):
        raise ValueError("gradient_checkpointing needs a HiddenStatesForward (its model)")
    with checkpointed(forward.model):
        return run(None, weights)


def count_rows(rows: Sequence[TrainRow]) -> dict[str, int]:
    """Rows per experiment: the denominators of the loss weights."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.experiment] = counts.get(row.experiment, 0) + 1
    return counts


def _fused_backward(
    forward: RoutedForward | HiddenStatesForward,
    rows: Sequence[TrainRow],
    losses: dict[str, PolicyLoss],
    pad_id: int,
    token_budget: int,
    shared_forward: SharedForward | None,
    weights: dict[str, float],
    lockstep: Lockstep | None = None,
) -> TrainStats:
    stats = TrainStats()
    for mb in _micro_batches(forward, rows, pad_id, token_budget, shared_forward):
        chunk = [rows[i] for i in mb.index]
        with_ref = _needs_ref(chunk, losses)
        if lockstep is not None:  # the same micro-batches and forwards on every rank
            with_ref = lockstep.micro_batch(with_ref)
        if mb.shared:
            stats.shared_micro_batches += 1
            stats.computed_tokens += int(mb.batch["prefix_attn"].sum())
            stats.computed_tokens += sum(len(r.completion_ids) for r in chunk)
        else:
            stats.computed_tokens += sum(r.length for r in chunk)
        loss = _micro_batch_loss(mb.run, chunk, mb.batch, losses, weights, stats, with_ref)
        loss.backward()
        stats.micro_batches += 1
    if lockstep is not None:  # out of rows: dummies while another rank still trains
        lockstep.drain_micro_batches(forward, pad_id)
    return stats


def _needs_ref(rows: Sequence[TrainRow], losses: dict[str, PolicyLoss]) -> bool:
    """Some row's experiment has a KL term: the micro-batch runs the reference forward."""
    return any(losses[r.experiment].needs_reference for r in rows)


@dataclass
class _MicroBatch:
    index: list[int]  # rows, in the batch's order
    batch: dict[str, torch.Tensor]
    run: Callable[[dict[str, torch.Tensor]], torch.Tensor]  # batch -> log-probs
    shared: bool  # ran with shared prompt prefixes: log-prob t is completion token t


def _micro_batches(
    forward: RoutedForward | HiddenStatesForward,
    rows: Sequence[TrainRow],
    pad_id: int,
    token_budget: int,
    shared_forward: SharedForward | None,
) -> Iterator[_MicroBatch]:
    """The update's micro-batches (``plan_micro_batches``), collated, with their forward."""
    for groups, shared in plan_micro_batches(rows, token_budget, shared_forward is not None):
        # Tenants contiguous inside the micro-batch: the LoRA layers then add the delta
        # in place instead of gathering rows and scattering them back (lora.Routing).
        groups = sorted(groups, key=lambda g: rows[g[0]].slot)
        index = [i for g in groups for i in g]
        if shared and shared_forward is not None:
            batch = _collate_shared([[rows[i] for i in g] for g in groups], pad_id)
            run = functools.partial(_shared_logprobs, shared_forward)
            yield _MicroBatch(index, batch, run, True)
        else:
            batch = collate_rows([rows[i] for i in index], pad_id)
            yield _MicroBatch(index, batch, functools.partial(row_logprobs, forward), False)


@torch.no_grad()
def score_rows(
    forward: RoutedForward | HiddenStatesForward,
    rows: Sequence[TrainRow],
    pad_id: int,
    token_budget: int,
    shared_forward: SharedForward | None = None,
    lockstep: Lockstep | None = None,
) -> list[torch.Tensor]:
    """Each row's log-probs of its completion tokens under the adapters as they are now,
    at the row's temperature: the trainer's own old log-probs (fp32, on the host).

    The same micro-batches and forward as ``fused_backward``, so on the update's pass the
    PPO ratio starts at exactly 1; no gradient and no graph are kept. The caller puts the
    model in eval mode (no dropout, as the rollout sampled). ``lockstep`` (a sharded
    base): every rank scores as many micro-batches as the busiest (dummy forwards once
    out of rows), since each forward is a collective.
    """
    out: list[torch.Tensor] = [torch.zeros(0)] * len(rows)
    for mb in _micro_batches(forward, rows, pad_id, token_budget, shared_forward):
        if lockstep is not None:
            lockstep.step()
        logprobs = mb.run(mb.batch).float().cpu()
        for j, i in enumerate(mb.index):
            start = 0 if mb.shared else len(rows[i].prompt_ids) - 1  # see the collates
            out[i] = logprobs[j, start : start + len(rows[i].completion_ids)].clone()
    if lockstep is not None:  # out of rows: dummies while another rank still scores
        lockstep.drain(functools.partial(lockstep.dummy_forward, forward, pad_id))
    return out
