"""How one tick's policy update is run across the adapters in play.

Two implementations of :class:`TrainingStrategy`: :class:`FusedTraining`, the engine's
(one forward/backward over every tenant's rows, then one optimiser step over all their
slots), and :class:`~loraplex_engine.dev.timesliced.TimeSlicedTraining`, the benchmark's
baseline arm (one adapter at a time, swapped in from host memory). Both share the
gradient maths (training.fused_backward) and the finiteness guard, so the benchmark
compares scheduling alone.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.train.algorithms import PolicyLoss
from loraplex_engine.train.chunked_logprobs import HiddenStatesForward
from loraplex_engine.train.optim import PerAdapterAdamW
from loraplex_engine.train.riders import TrainCall
from loraplex_engine.train.rows import RoutedForward, TrainRow
from loraplex_engine.train.shared_prefix import SharedForward
from loraplex_engine.train.step import TokenTotals, TrainStats, fused_backward, score_rows

if TYPE_CHECKING:
    from loraplex_engine.parallel.lockstep import Lockstep

TRAIN_MODES = ("fused", "timesliced")

log = logging.getLogger("loraplex_engine.train.step")


@dataclass(frozen=True)
class TrainOutcome:
    """One experiment's update: applied, or refused (its adapter is left as it was)."""

    failure: str | None = None  # why the update was refused
    # Mean |log p_sampler - log p_trainer| over the step's sampled tokens, when the
    # trainer recomputed the old log-probs (a vLLM rollout); None when it did not.
    logprob_gap: float | None = None
    # Mean truncated-importance weight over the step's sampled tokens and how many it
    # weighted (offPolicyCorrection: tis; every rank's rows under data parallelism);
    # None and 0 where the loss applies no TIS.
    tis_weight_mean: float | None = None
    tis_tokens: int = 0
    # The loss's mean KL to the base and share of clipped tokens over the step's sampled
    # tokens (every rank's); None where no token was trained.
    kl: float | None = None
    clip_fraction: float | None = None

    def finite(self) -> TrainOutcome:
        """Its statistics with a non-finite one as None: a sampled token the trainer finds
        impossible makes the gap infinite (and normally the loss too), and a status or
        summary.json carries no inf."""
        return dataclasses.replace(
            self,
            logprob_gap=_finite(self.logprob_gap),
            tis_weight_mean=_finite(self.tis_weight_mean),
            kl=_finite(self.kl),
            clip_fraction=_finite(self.clip_fraction),
        )


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


@dataclass(frozen=True)
class StepTotals:
    """One update's per-experiment statistics over some rows, as sums and counts: a
    data-parallel rank totals its share and rank 0 adds every rank's (:func:`with_totals`)."""

    gaps: TokenTotals = field(default_factory=dict)  # |sampler - trainer| log-prob (rescored)
    tis: TokenTotals = field(default_factory=dict)  # the TIS weight (TrainStats.tis)
    kl: TokenTotals = field(default_factory=dict)  # the loss's KL (TrainStats.kl)
    clip: TokenTotals = field(default_factory=dict)  # clipped tokens (TrainStats.clip)

    @classmethod
    def of(cls, gaps: TokenTotals, stats: TrainStats) -> StepTotals:
        """One rank's totals: its rescoring's gaps and its backward's statistics."""
        return cls(gaps, stats.tis, stats.kl, stats.clip)


class TrainingStrategy(Protocol):
    computed_tokens: int  # tokens through the policy forward so far (benchmarks)

    def train(self, rows: list[TrainRow], losses: dict[str, PolicyLoss]) -> dict[str, TrainOutcome]:
        """One policy-gradient step for every experiment in ``losses`` (its rows are
        those with its id); the model is in train mode throughout."""
        ...


@dataclass
class AdapterTrainer:
    """Backward over rows and a guarded optimiser step, shared by both strategies.

    The policy forward stops at the final hidden states and the log-probs are computed
    chunk by chunk (train/chunked_logprobs.py: no ``[rows, tokens, vocab]`` fp32 logits); a
    model whose head transforms its logits (soft-capping, scaling) keeps the logits
    forward, and then cannot be checkpointed.

    ``recompute_old_logprobs`` (set by the engine for a vLLM rollout): the sampler is
    another program with its own kernels and precision, so its log-probs are not this
    model's. Before the update the trainer scores the sampled tokens itself (eval mode,
    no gradient) and trains with those as the old policy, keeping the sampler's as the
    behaviour policy (TIS, the off-policy gap). The torch rollout samples with this very
    model, so its log-probs already are the old policy's and nothing is recomputed.
    """

    model: MultiLoRAModel
    optimizer: PerAdapterAdamW
    device: torch.device
    pad_id: int
    micro_batch_tokens: int
    shared_forward: SharedForward | None
    gradient_checkpointing: bool = False
    computed_tokens: int = 0
    passes: int = 0  # forward/backward passes over rows (the engine's metrics count them)
    # Client models' calls that ride this tick's update (train/riders.py): set by the
    # tick's client work before the update, taken by the next backward.
    riders: list[TrainCall] = dataclasses.field(default_factory=list)
    recompute_old_logprobs: bool = False
    # A sharded base (parallel/sharding.py): the ranks' micro-batches run in step.
    lockstep: Lockstep | None = None

    def __post_init__(self) -> None:
        self._forward: HiddenStatesForward | None = None
        try:
            self._forward = HiddenStatesForward(self.model, self.device)
        except ValueError as e:
            log.warning("log-probs from full logits (%s)", e)
            if self.gradient_checkpointing:
                log.warning("gradient checkpointing off: it needs the hidden-states forward")
                self.gradient_checkpointing = False

    @property
    def policy_forward(self) -> RoutedForward | HiddenStatesForward:
        """The forward the update runs (client models' rows go through it too)."""
        return self._forward or self._routed_forward

    def with_trainer_old_logprobs(
        self, rows: list[TrainRow]
    ) -> tuple[list[TrainRow], dict[str, float]]:
        """``rows`` with the trainer's own old log-probs (the sampler's kept as behaviour)
        and each experiment's off-policy gap; as given, and no gaps, when not recomputing."""
        rescored, totals = self.rescore(rows)
        return rescored, mean_gaps([totals])

    def rescore(self, rows: list[TrainRow]) -> tuple[list[TrainRow], GapTotals]:
        """:meth:`with_trainer_old_logprobs` with the gaps as sums and counts (a
        data-parallel rank rescores its own rows; rank 0 averages every rank's)."""
        if not self.recompute_old_logprobs:
            return rows, {}
        if not rows and self.lockstep is None:
            return rows, {}
        was_training = self.model.training
        self.model.eval()  # as the rollout ran: no adapter dropout
        # The micro-batches the update will run: a checkpointed update trains unshared
        # (training.fused_backward), so the ratio starts at exactly 1 there too.
        shared = None if self.gradient_checkpointing else self.shared_forward
        try:
            old = score_rows(
                self._forward or self._routed_forward,
                rows,
                self.pad_id,
                self.micro_batch_tokens,
                shared,
                self.lockstep,
            )
        finally:
            self.model.train(was_training)
        rescored = [
            dataclasses.replace(r, old_logprobs=o.tolist(), behaviour_logprobs=r.old_logprobs)
            for r, o in zip(rows, old, strict=True)
        ]
        return rescored, gap_totals(rows, old)

    def backward(
        self,
        rows: list[TrainRow],
        losses: dict[str, PolicyLoss],
        row_counts: dict[str, int] | None = None,
    ) -> TrainStats:
        """Accumulate the rows' gradients; ``row_counts``: training.fused_backward's."""
        riders, self.riders = self.riders, []
        stats = fused_backward(
            self._forward or self._routed_forward,
            rows,
            losses,
            self.pad_id,
            self.micro_batch_tokens,
            self.shared_forward,
            gradient_checkpointing=self.gradient_checkpointing,
            row_counts=row_counts,
            lockstep=self.lockstep,
            riders=riders,
        )
        self.computed_tokens += stats.computed_tokens
        self.passes += 1
        return stats

    def _routed_forward(
        self, ids: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            slot_ids=slots.to(self.device),
        )
        # Logits stay on the device: the loss and its backward run there (the batch
        # tensors follow the logits, training._logprobs).
        return out.logits.float()

    def step_finite(self, exp_ids: list[str]) -> dict[str, TrainOutcome]:
        """Optimiser step for every adapter whose gradient is finite; refuse the others,
        and report any whose weights came out non-finite."""
        slot = {e: self.model.slot_of(e) for e in exp_ids}
        mine = list(slot.values())
        grad_ok = self._finite_slots(
            (p.grad for p in self.optimizer.params if p.grad is not None), mine
        )
        outcomes: dict[str, TrainOutcome] = {}
        for e in exp_ids:
            if not grad_ok[slot[e]]:
                self._clear_grad(slot[e])
                outcomes[e] = TrainOutcome("non-finite gradient (loss diverged)")
        self.optimizer.step([slot[e] for e in exp_ids if e not in outcomes])
        weights_ok = self._finite_slots((p.data for p in self.optimizer.params), mine)
        for e in exp_ids:
            if e not in outcomes:
                ok = weights_ok[slot[e]]
                outcomes[e] = TrainOutcome(
                    None if ok else "non-finite adapter weights after the update"
                )
        return outcomes

    def _finite_slots(self, tensors: Iterable[torch.Tensor], slots: list[int]) -> dict[int, bool]:
        """Per slot in ``slots``: every entry of the stacked tensors finite. One check per
        tensor over the slice of slots in play (a view), one host sync in all, instead of
        one sync per slot and tensor (~5,700 tiny checks per tick at 8 adapters)."""
        lo, hi = min(slots), max(slots) + 1
        ok = torch.ones(hi - lo, dtype=torch.bool, device=self.device)
        for t in tensors:
            ok &= torch.isfinite(t[lo:hi]).flatten(1).all(1)
        flags = ok.tolist()
        return {s: flags[s - lo] for s in slots}

    def _clear_grad(self, slot: int) -> None:
        for p in self.optimizer.params:
            if p.grad is not None:
                p.grad[slot].zero_()


class FusedTraining(AdapterTrainer):
    """Every adapter's rows in one forward/backward, then one step over all slots."""

    def train(self, rows: list[TrainRow], losses: dict[str, PolicyLoss]) -> dict[str, TrainOutcome]:
        rows, gaps = self.rescore(rows)
        self.optimizer.zero_grad()
        stats = self.backward(rows, losses)
        return with_totals(self.step_finite(list(losses)), [StepTotals.of(gaps, stats)])


def logprob_gaps(rows: list[TrainRow], trainer: list[torch.Tensor]) -> dict[str, float]:
    """Per experiment, mean |sampler's - trainer's log-prob| over its sampled tokens.

    ``rows`` carry the sampler's log-probs (``old_logprobs`` as the rollout gave them),
    ``trainer`` the recomputed ones, row for row."""
    return mean_gaps([gap_totals(rows, trainer)])


# Per experiment: (sum of |sampler - trainer| over its sampled tokens, how many tokens).
GapTotals = TokenTotals


def gap_totals(rows: list[TrainRow], trainer: list[torch.Tensor]) -> GapTotals:
    """What :func:`logprob_gaps` averages, as sums and counts: the ranks of a data-parallel
    update each total their own rows, and rank 0 averages over all (:func:`mean_gaps`)."""
    out: GapTotals = {}
    for row, mine in zip(rows, trainer, strict=True):
        sampler = torch.tensor(row.old_logprobs, dtype=torch.float32)
        gap = (sampler - mine).abs()
        if row.mask is not None:  # an environment's tokens were not sampled: no gap
            keep = torch.tensor(row.mask, dtype=torch.bool)
            gap = gap[keep]
        total, n = out.get(row.experiment, (0.0, 0))
        out[row.experiment] = (total + float(gap.sum()), n + len(gap))
    return out


def mean_gaps(parts: Iterable[GapTotals]) -> dict[str, float]:
    """Per experiment, the mean gap over every part's tokens (0.0 where it has none)."""
    return {e: total / n if n else 0.0 for e, (total, n) in sum_totals(parts).items()}


def sum_totals(parts: Iterable[TokenTotals]) -> TokenTotals:
    """Per experiment, every part's sum and count added up."""
    out: TokenTotals = {}
    for part in parts:
        for exp, (total, n) in part.items():
            acc, count = out.get(exp, (0.0, 0))
            out[exp] = (acc + total, count + n)
    return out


def with_totals(
    outcomes: dict[str, TrainOutcome], parts: Sequence[StepTotals]
) -> dict[str, TrainOutcome]:
    """``outcomes`` with the off-policy statistics of ``parts`` (one per rank) combined:
    each experiment's mean gap, its mean TIS weight over every token it weighted, and its
    mean KL and clip fraction over every token trained."""
    gaps = mean_gaps(p.gaps for p in parts)
    tis = sum_totals(p.tis for p in parts)
    kl = sum_totals(p.kl for p in parts)
    clip = sum_totals(p.clip for p in parts)
    out = {}
    for e, o in outcomes.items():
        if e in gaps:
            o = dataclasses.replace(o, logprob_gap=gaps[e])
        total, n = tis.get(e, (0.0, 0))
        if n:
            o = dataclasses.replace(o, tis_weight_mean=total / n, tis_tokens=n)
        (kl_sum, kl_n), (clip_sum, clip_n) = kl.get(e, (0.0, 0)), clip.get(e, (0.0, 0))
        if kl_n:
            o = dataclasses.replace(o, kl=kl_sum / kl_n, clip_fraction=clip_sum / clip_n)
        out[e] = o
    return out
