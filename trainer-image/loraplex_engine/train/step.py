"""The maths of one RL policy update for many adapters: one forward/backward over the
rows given, packed into token-budgeted micro-batches. Who is in one call (every tenant,
or one adapter at a time) is the training strategy's choice (train/strategy.py).

Loss normalisation: every row carries ``weight = 1 / rows of its experiment``, so the
summed loss over any packing of rows into micro-batches is the sum over experiments
of each experiment's mean sequence loss. Rows of one experiment depend only on its
adapter, hence each adapter's gradient equals what it would get trained alone.

Shared prompt prefixes: GRPO trains ``groupSize`` completions of one prompt. Rather than
run every row as prompt + completion, a micro-batch runs each group's prompt (all but its
last token) once, with gradient, expands the resulting KV cache to the group's rows and
runs the completions on top of it (``SharedForward``, train/shared_prefix.py, which also says
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

from loraplex_engine.lora.gradient_checkpointing import gradient_checkpointing as checkpointed
from loraplex_engine.train.algorithms import LossInputs, PolicyLoss
from loraplex_engine.train.chunked_logprobs import HiddenStatesForward
from loraplex_engine.train.riders import (
    PassItem,
    RiderBatch,
    TrainCall,
    collate_riders,
    joint_logprobs,
    rider_items,
    rider_loss,
    start_outputs,
)
from loraplex_engine.train.rows import (
    RoutedForward,
    TrainRow,
    collate_rows,
    collate_shared,
    count_rows,
    dummy_backward,
    dummy_forward,
    pack_micro_batches,
    pack_micro_batches_shared,
    row_logprobs,
    shared_logprobs,
)
from loraplex_engine.train.shared_prefix import SharedForward

if TYPE_CHECKING:
    from loraplex_engine.parallel.lockstep import Lockstep

# Per experiment: (sum of a per-token statistic over its sampled tokens, how many tokens).
# Sums and counts, not means: the ranks of a data-parallel update each total their own
# rows, and rank 0 adds every rank's (train/strategy.py: StepTotals).
TokenTotals = dict[str, tuple[float, int]]


@dataclass
class TrainStats:
    loss: dict[str, float] = field(default_factory=dict)
    # The loss's KL and clip fraction, each a token mean per micro-batch, weighted here by
    # its completion tokens (so the step's mean is over every token, however packed).
    kl: TokenTotals = field(default_factory=dict)
    clip: TokenTotals = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)  # logical: prompt + completion per row
    micro_batches: int = 0
    shared_micro_batches: int = 0  # of which ran with shared prompt prefixes
    computed_tokens: int = 0  # real tokens through the policy forward (a shared prefix once)
    # The TIS weight over the completion tokens it multiplied (experiments whose loss
    # applies it: LossOutput.tis_mean), so its mean and how many tokens it reached.
    tis: TokenTotals = field(default_factory=dict)


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
        stats.tokens[exp] = stats.tokens.get(exp, 0) + sum(
            r.length for r in rows if r.experiment == exp
        )
        n = int(batch["mask"][index].sum())  # these rows' completion tokens
        _add_mean(stats.kl, exp, float(out.kl), n)
        _add_mean(stats.clip, exp, float(out.clip_fraction), n)
        if out.tis_mean is not None:  # a mean over these rows' completion tokens
            _add_mean(stats.tis, exp, float(out.tis_mean), n)
    return total


def _add_mean(totals: TokenTotals, exp: str, mean: float, n: int) -> None:
    """Add a mean over ``n`` tokens to ``exp``'s sum and count."""
    total, count = totals.get(exp, (0.0, 0))
    totals[exp] = (total + mean * n, count + n)


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
    riders: Sequence[TrainCall] = (),
) -> TrainStats:
    """Accumulate every adapter's gradient over all rows; the caller steps the optimiser.

    ``riders``: client models' calls (train/riders.py), in the same micro-batch plan as
    the unshared rows and the same forward and backward; their outputs are filled in
    and their gradients land in their own slots of ``.grad``.

    With ``shared_forward``, the rows of one prompt group compute their prompt once per
    micro-batch (``plan_micro_batches`` says which micro-batches do). A
    ``HiddenStatesForward`` computes the log-probs chunk by chunk (train/chunked_logprobs.py).
    ``gradient_checkpointing`` recomputes each decoder layer in the backward under the
    same routing (lora/gradient_checkpointing.py); it needs a ``HiddenStatesForward`` (for
    its model) and trains unshared, since a checkpointed layer keeps no KV cache to share.
    ``row_counts`` (rows per experiment; default: counted in ``rows``) are the loss
    weights' denominators: data parallelism (parallel/data_parallel.py) passes the whole tick's,
    so each rank's share of the rows gives its share of the one-rank gradient.
    ``lockstep`` (a sharded base, parallel/sharding.py): every rank runs as many micro-batches as
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
        _fused_backward, forward, rows, losses, pad_id, token_budget, lockstep=lockstep,
        riders=riders,
    )  # fmt: skip
    if not gradient_checkpointing:
        return run(shared_forward, weights)
    if not isinstance(forward, HiddenStatesForward):
        raise ValueError("gradient_checkpointing needs a HiddenStatesForward (its model)")
    with checkpointed(forward.model):
        return run(None, weights)


def _fused_backward(
    forward: RoutedForward | HiddenStatesForward,
    rows: Sequence[TrainRow],
    losses: dict[str, PolicyLoss],
    pad_id: int,
    token_budget: int,
    shared_forward: SharedForward | None,
    weights: dict[str, float],
    lockstep: Lockstep | None = None,
    riders: Sequence[TrainCall] = (),
) -> TrainStats:
    stats = TrainStats()
    start_outputs(riders)
    for mb in _micro_batches(forward, rows, pad_id, token_budget, shared_forward, riders):
        chunk = [rows[i] for i in mb.index]
        loss = None
        if chunk or lockstep is not None:
            loss = _rows_loss(mb, chunk, losses, weights, stats, lockstep)
        else:  # riders alone: their forward
            mb.run({})
        if mb.riders is not None:
            stats.computed_tokens += sum(it.length for it in mb.riders.items)
            extra = rider_loss(riders, mb.riders)
            loss = extra if loss is None else loss if extra is None else loss + extra
        if loss is not None and loss.requires_grad:
            loss.backward()
        stats.micro_batches += 1
    if lockstep is not None:  # out of rows: dummies while another rank still trains
        lockstep.drain_micro_batches(functools.partial(dummy_backward, forward, pad_id))
    return stats


def _rows_loss(
    mb: _MicroBatch,
    chunk: list[TrainRow],
    losses: dict[str, PolicyLoss],
    weights: dict[str, float],
    stats: TrainStats,
    lockstep: Lockstep | None,
) -> torch.Tensor:
    with_ref = _needs_ref(chunk, losses)
    if lockstep is not None:  # the same micro-batches and forwards on every rank
        with_ref = lockstep.micro_batch(with_ref)
    if mb.shared:
        stats.shared_micro_batches += 1
        stats.computed_tokens += int(mb.batch["prefix_attn"].sum())
        stats.computed_tokens += sum(len(r.completion_ids) for r in chunk)
    else:
        stats.computed_tokens += sum(r.length for r in chunk)
    return _micro_batch_loss(mb.run, chunk, mb.batch, losses, weights, stats, with_ref)


def _needs_ref(rows: Sequence[TrainRow], losses: dict[str, PolicyLoss]) -> bool:
    """Some row's experiment has a KL term: the micro-batch runs the reference forward."""
    return any(losses[r.experiment].needs_reference for r in rows)


@dataclass
class _MicroBatch:
    index: list[int]  # rows, in the batch's order
    batch: dict[str, torch.Tensor]
    run: Callable[[dict[str, torch.Tensor]], torch.Tensor]  # batch -> log-probs
    shared: bool  # ran with shared prompt prefixes: log-prob t is completion token t
    riders: RiderBatch | None = None  # client data in the same forward (train/riders.py)


def _micro_batches(
    forward: RoutedForward | HiddenStatesForward,
    rows: Sequence[TrainRow],
    pad_id: int,
    token_budget: int,
    shared_forward: SharedForward | None,
    riders: Sequence[TrainCall] = (),
) -> Iterator[_MicroBatch]:
    """The update's micro-batches (``plan_micro_batches``), collated, with their forward;
    with ``riders`` the unshared rows and the riders' data are packed together."""
    plan = plan_micro_batches(rows, token_budget, shared_forward is not None)
    if riders:
        loose = [i for groups, shared in plan if not shared for g in groups for i in g]
        plan = [(groups, shared) for groups, shared in plan if shared]
        yield from _with_riders(forward, rows, loose, riders, pad_id, token_budget)
    for groups, shared in plan:
        # Tenants contiguous inside the micro-batch: the LoRA layers then add the delta
        # in place instead of gathering rows and scattering them back (lora.Routing).
        groups = sorted(groups, key=lambda g: rows[g[0]].slot)
        index = [i for g in groups for i in g]
        if shared and shared_forward is not None:
            batch = collate_shared([[rows[i] for i in g] for g in groups], pad_id)
            run = functools.partial(shared_logprobs, shared_forward)
            yield _MicroBatch(index, batch, run, True)
        else:
            batch = collate_rows([rows[i] for i in index], pad_id)
            yield _MicroBatch(index, batch, functools.partial(row_logprobs, forward), False)


def _with_riders(
    forward: RoutedForward | HiddenStatesForward,
    rows: Sequence[TrainRow],
    loose: list[int],
    riders: Sequence[TrainCall],
    pad_id: int,
    token_budget: int,
) -> Iterator[_MicroBatch]:
    """Micro-batches of the unshared rows ``loose`` and the riders' data, one plan."""
    items = [PassItem(rows[i].length, row=i) for i in loose] + rider_items(riders)
    for batch in pack_micro_batches(items, token_budget):  # type: ignore[arg-type]
        mine = [items[k] for k in batch]
        index = sorted((it.row for it in mine if it.row is not None), key=lambda i: rows[i].slot)
        data = sorted(
            (it for it in mine if it.call is not None), key=lambda it: riders[it.call or 0].slot
        )
        width = max(it.length for it in mine)
        exp = collate_rows([rows[i] for i in index], pad_id, width) if index else {}
        if not data:
            yield _MicroBatch(index, exp, functools.partial(row_logprobs, forward), False)
            continue
        on = collate_riders(riders, data, pad_id, width)
        yield _MicroBatch(index, exp, _joint(forward, on), False, on)


def _joint(
    forward: RoutedForward | HiddenStatesForward, riders: RiderBatch
) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """The micro-batch's forward: the first call runs every row (the riders' log-probs
    kept on ``riders``); a later one (the KL reference) the experiments' rows alone."""
    first = [True]

    def run(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if first[0]:
            first[0] = False
            out = joint_logprobs(forward, batch or None, riders)
            return out if out is not None else torch.zeros(0)
        return row_logprobs(forward, batch)

    return run


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
        lockstep.drain(functools.partial(dummy_forward, forward, pad_id))
    return out
