"""Data-parallel training: the tick's policy update spread over N ranks (issue 17).

First slice: rank 0 runs the whole tick (rollout, rewards, checkpoints) and, in its
train phase, broadcasts the tick's rows; every rank trains its share of them
(row_split.py: whole prompt groups, token-balanced), the LoRA gradients are summed over
the ranks (distributed.all_reduce_lora_grads) and every rank takes the same per-adapter
AdamW step on the same summed gradient, so every rank's adapters stay equal to rank 0's.
Workers (ranks 1..N-1) do nothing else: they wait for rank 0's next train phase
(:meth:`DataParallelTraining.follow`).

Rollouts (torch backend): rank 0 sends the tick's rollout rows (rollout/ranks.py) with
the split (row_split.split_rollout: whole sampling streams per rank, token-balanced);
every rank decodes its share with the same adapters, and rank 0 gathers the
completions (``gather_object``) and the generators' new states for the rewards. Under a
sharded base (sharding.py) the ranks decode in lockstep, since every forward is a
collective.

Adapter slots: every rank loads the same experiments in the same order (the local
runner does), so each holds every adapter in the same slot; the first time an adapter
trains, rank 0's weights and optimiser state are broadcast to the others, so a seed,
a resumed checkpoint or any other difference in how a rank built it cannot make the
ranks disagree.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from loraplex_engine import distributed
from loraplex_engine.algorithms import get_algorithm
from loraplex_engine.distributed import World
from loraplex_engine.errors import UsageError
from loraplex_engine.lora import LoRAConfig
from loraplex_engine.optim import AdamWSettings
from loraplex_engine.rollout import ranks
from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.row_split import split_rollout, split_rows_by_rank
from loraplex_engine.sharding import Lockstep
from loraplex_engine.training import ExperimentUpdate, TrainRow, count_rows
from loraplex_engine.training_strategy import FusedTraining, TrainOutcome


@dataclass(frozen=True)
class UpdateSpec:
    """An ExperimentUpdate by value: the algorithm by name, looked up on each rank."""

    algorithm: str
    clip: float
    kl_coef: float


@dataclass(frozen=True)
class NewAdapter:
    """An adapter the workers have not had from rank 0 yet: what they check theirs
    against before its tensors are broadcast."""

    slot: int
    config: LoRAConfig
    settings: AdamWSettings
    step: int


@dataclass(frozen=True)
class TrainMessage:
    """Rank 0's train phase, as every rank needs it."""

    rows: list[TrainRow]
    updates: dict[str, UpdateSpec]
    slots: dict[str, int]  # every experiment in ``updates``: its slot on rank 0
    new: dict[str, NewAdapter]


@dataclass(frozen=True)
class RolloutMessage:
    """Rank 0's rollout phase: the rows, who decodes which, adapters to sync first."""

    batch: ranks.WireBatch
    slots: dict[str, int]  # every loaded adapter: its slot on rank 0
    new: dict[str, NewAdapter]


# This rank's own torch rollout (TorchRollout.generate_local), set by the engine.
LocalDecode = Callable[[Sequence[RolloutRequest]], list[Completion]]


@dataclass
class DataParallelTraining(FusedTraining):
    """FusedTraining over the ranks of ``world`` (the default process group)."""

    world: World = field(default_factory=lambda: World(0, 1))
    decode: LocalDecode | None = None  # set when the ranks share the rollouts

    def __post_init__(self) -> None:
        super().__post_init__()
        self._synced: dict[str, int] = {}  # adapter -> slot, as last broadcast from rank 0

    # ---- rank 0 ----------------------------------------------------------------------

    def train(
        self, rows: list[TrainRow], updates: dict[str, ExperimentUpdate]
    ) -> dict[str, TrainOutcome]:
        if not self.world.is_leader:
            raise RuntimeError("only rank 0 drives the tick; workers follow()")
        slots = {e: self.model.slot_of(e) for e in updates}
        new = self._unsynced(slots)
        specs = {e: UpdateSpec(u.algorithm.name, u.clip, u.kl_coef) for e, u in updates.items()}
        distributed.broadcast_object(TrainMessage(rows, specs, slots, new), self.device)
        return self._apply(rows, updates, slots, new)

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[Completion]:
        """Decode ``requests`` over the ranks; every rank's completions, in order."""
        if not self.world.is_leader or self.decode is None:
            raise RuntimeError("rank 0 drives the rollout, with the engine's decode set")
        shares = split_rollout(requests, self.world.size)
        slots = self.model.adapters()
        new = self._unsynced(slots)
        msg = RolloutMessage(ranks.to_wire(requests, shares), slots, new)
        distributed.broadcast_object(msg, self.device)
        self._sync_new(new)
        streams, generators = ranks.stream_ids(requests)
        mine = shares[0]
        done = self.decode([requests[i] for i in mine])
        results = self._gather(ranks.share_result(mine, done, streams, generators))
        assert results is not None
        return ranks.merge(results, len(requests), generators)

    def _unsynced(self, slots: dict[str, int]) -> dict[str, NewAdapter]:
        """The adapters of ``slots`` the workers have not had from rank 0 in that slot
        (those with optimiser state: what ``_sync_new`` sends)."""
        return {
            e: NewAdapter(
                s, self.model.config_of(e), self.optimizer.settings[s], self.optimizer.steps[s]
            )
            for e, s in slots.items()
            if self._synced.get(e) != s and self.optimizer.has_adapter(e)
        }

    def stop(self) -> None:
        """Release the workers: they leave follow() and exit."""
        if self.world.is_leader:
            distributed.broadcast_object(None, self.device)

    # ---- workers ---------------------------------------------------------------------

    def follow(self) -> int:
        """Run rank 0's train phases until it stops; returns how many there were."""
        if self.world.is_leader:
            raise RuntimeError("rank 0 drives the tick; only workers follow()")
        phases = 0
        while (msg := distributed.broadcast_object(None, self.device)) is not None:
            if isinstance(msg, RolloutMessage):
                self._follow_rollout(msg)
                continue
            updates = {
                e: ExperimentUpdate(get_algorithm(u.algorithm), u.clip, u.kl_coef)
                for e, u in msg.updates.items()
            }
            self._check_adapters(msg)
            self.model.train()
            try:
                self._apply(msg.rows, updates, msg.slots, msg.new)
            finally:
                self.model.eval()
            phases += 1
        return phases

    def _follow_rollout(self, msg: RolloutMessage) -> None:
        """Decode this rank's share of rank 0's rollout and send it back."""
        if self.decode is None:
            raise RuntimeError(f"rank {self.world.rank}: a rollout came, but no decode is set")
        self._check_adapters(msg)
        self._sync_new(msg.new)
        requests, generators = ranks.from_wire(msg.batch)
        mine = msg.batch.shares[self.world.rank]
        done = self.decode([requests[i] for i in mine])
        self._gather(ranks.share_result(mine, done, msg.batch.streams, generators))

    def _gather(self, result: ranks.ShareResult) -> list[ranks.ShareResult] | None:
        """Every rank's result on rank 0 (None elsewhere)."""
        box: list[Any] | None = [None] * self.world.size if self.world.is_leader else None
        dist.gather_object(result, box, dst=0)
        return box

    def _check_adapters(self, msg: TrainMessage | RolloutMessage) -> None:
        """This worker holds every adapter in rank 0's slot, and new ones as rank 0 built
        them (same rank and targets: the tensors about to be broadcast fit)."""
        mine = self.model.adapters()
        for name, slot in msg.slots.items():
            if mine.get(name) != slot:
                raise RuntimeError(
                    f"rank {self.world.rank}: adapter {name!r} is in slot {slot} on rank 0 "
                    f"but {mine.get(name)} here: every rank must load the same experiments"
                )
        for name, new in msg.new.items():
            if self.model.config_of(name) != new.config:
                raise RuntimeError(
                    f"rank {self.world.rank}: adapter {name!r} has LoRA config "
                    f"{self.model.config_of(name)} here but {new.config} on rank 0"
                )

    # ---- every rank ------------------------------------------------------------------

    def _apply(
        self,
        rows: list[TrainRow],
        updates: dict[str, ExperimentUpdate],
        slots: dict[str, int],
        new: dict[str, NewAdapter],
    ) -> dict[str, TrainOutcome]:
        if not slots:  # nothing to train (the tick does not call; kept in step anyway)
            return {}
        self._sync_new(new)
        share = split_rows_by_rank(rows, self.world.size)[self.world.rank]
        self.optimizer.zero_grad()
        self.backward(share, updates, count_rows(rows))
        in_play = slice(min(slots.values()), max(slots.values()) + 1)
        distributed.all_reduce_lora_grads(self.optimizer.params, in_play)
        return self.step_finite(list(updates))

    @torch.no_grad()
    def _sync_new(self, new: dict[str, NewAdapter]) -> None:
        """Rank 0's weights, moments, settings and step count of each new adapter."""
        for name in sorted(new):
            n = new[name]
            self.optimizer.settings[n.slot] = n.settings
            self.optimizer.steps[n.slot] = n.step
            views = self.model.adapter_views(name)
            tensors = list(views.values())
            for moments in (self.optimizer.exp_avg, self.optimizer.exp_avg_sq):
                tensors += self.model.adapter_views(name, moments.__getitem__).values()
            distributed.broadcast_tensors(tensors)
            self._synced[name] = n.slot


def check_train_mode(world_size: int, train_mode: str) -> None:
    """Data parallelism splits the fused update; the time-sliced baseline is one rank's."""
    if world_size > 1 and train_mode != "fused":
        raise UsageError(f"--world-size {world_size} needs --train-mode fused, not {train_mode}")


def data_parallel_trainer(
    world: World, train_mode: str, lockstep: Lockstep | None = None
) -> functools.partial[FusedTraining]:
    """The Engine's training strategy class for ``world`` (``lockstep``: a sharded base)."""
    check_train_mode(world.size, train_mode)
    return functools.partial(DataParallelTraining, world=world, lockstep=lockstep)
