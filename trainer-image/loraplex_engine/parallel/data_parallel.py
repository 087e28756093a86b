"""Data-parallel training: the tick's policy update spread over N ranks (issue 17).

First slice: rank 0 runs the whole tick (rollout, rewards, checkpoints) and, in its
train phase, broadcasts the tick's rows; every rank trains its share of them
(train/row_split.py: whole prompt groups, token-balanced), the LoRA gradients are summed over
the ranks (distributed.all_reduce_lora_grads) and every rank takes the same per-adapter
AdamW step on the same summed gradient, so every rank's adapters stay equal to rank 0's.
Workers (ranks 1..N-1) do nothing else: they run rank 0's messages, one kind at a time
(:meth:`DataParallelTraining.follow` dispatches on the message's type), until rank 0
stops them.

Rollouts (torch backend): rank 0 sends the tick's rollout rows (:class:`RolloutMessage`,
parallel/rollout_shares.py) with the split (row_split.split_rollout: whole sampling streams per
rank, token-balanced); every rank decodes its share with the same adapters, and rank 0
gathers the completions (``gather_object``) and the generators' new states for the
rewards. Under a sharded base (parallel/sharding.py) the ranks decode in lockstep, since every
forward is a collective.

Rollouts (vLLM backend): rank 0 alone runs the vLLM worker and decodes every row (one
vLLM per pod, with ``tensor_parallel_size`` over the pod's GPUs under a sharded base;
rollout/vllm/config.py); the workers start none and get no rollout message. Since vLLM is
another program, each rank rescores its own share of the rows in its train phase (the
trainer's old log-probs, AdapterTrainer.rescore: the adapters are equal on every rank,
so a row scores as on one rank). After the backward one gather brings every rank's
off-policy statistics of its share to rank 0 (sums and counts, strategy.StepTotals): the
sampler-trainer gap, and the TIS weight with the number of tokens it weighted, so a rank
that trained without rank 0's correction would show in the count.

Adapter slots: rank 0 alone decides which experiments are loaded (the runner's manifest,
the server's API). Each add and remove is a message to the workers (:class:`AddAdapter`,
:class:`RemoveAdapter`, sent under the engine's model lock, so between ticks and in
rank 0's order): every rank then holds the same adapters in the same slots. The first
time an adapter trains after its add, rank 0's weights and optimiser state are broadcast
to the others, so a seed, a resumed checkpoint or any other difference in how a rank
built it cannot make the ranks disagree (the workers never read a checkpoint).

Rank 0's collectives are serialised by one lock (a train phase, an add from an API
thread and an idle heartbeat never interleave); an idle rank 0 sends a
:class:`Heartbeat` every ``heartbeat_s``, so a worker waiting for the next message
never hits the group's timeout while the server has nothing to train.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from loraplex_engine.lora.layers import LoRAConfig
from loraplex_engine.parallel import distributed, rollout_shares
from loraplex_engine.parallel.distributed import World
from loraplex_engine.parallel.lockstep import Lockstep
from loraplex_engine.parallel.rollout_shares import ShareResult
from loraplex_engine.rollout.backends import RolloutBackend, TorchRollout
from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.settings.engine import check_train_mode
from loraplex_engine.train.algorithms import PolicyLoss
from loraplex_engine.train.optim import AdamWSettings
from loraplex_engine.train.row_split import split_rollout, split_rows_by_rank
from loraplex_engine.train.rows import TrainRow, count_rows
from loraplex_engine.train.strategy import FusedTraining, StepTotals, TrainOutcome, with_totals

log = logging.getLogger("loraplex_engine.parallel.data_parallel")

# An idle rank 0 tells its workers it is alive this often (at most; see heartbeat_s).
HEARTBEAT_S = 30.0


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
    # Each experiment's loss, whole (its settings are its fields): every rank applies
    # exactly rank 0's.
    losses: dict[str, PolicyLoss]
    slots: dict[str, int]  # every experiment in ``losses``: its slot on rank 0
    new: dict[str, NewAdapter]
    # Rank 0 rescores the sampled rows (a vLLM rollout): so must every rank, its share.
    rescore: bool = False


@dataclass(frozen=True)
class AddAdapter:
    """Rank 0 loaded adapter ``name`` into ``slot``: every worker adds it there too (its
    tensors follow with the adapter's first train phase, as a :class:`NewAdapter`)."""

    name: str
    slot: int
    config: LoRAConfig
    settings: AdamWSettings


@dataclass(frozen=True)
class RemoveAdapter:
    """Rank 0 unloaded adapter ``name`` from ``slot``: every worker frees the slot."""

    name: str
    slot: int


@dataclass(frozen=True)
class Heartbeat:
    """Rank 0 is alive and idle (keeps a waiting worker inside the group's timeout)."""


@dataclass(frozen=True)
class RolloutMessage:
    """Rank 0's rollout phase: the rows, who decodes which, adapters to sync first."""

    batch: rollout_shares.WireBatch
    slots: dict[str, int]  # every loaded adapter: its slot on rank 0
    new: dict[str, NewAdapter]


# This rank's own torch rollout (TorchRollout.generate_local), set by the engine.
LocalDecode = Callable[[Sequence[RolloutRequest]], list[Completion]]


@dataclass(frozen=True)
class CompareAdapters:
    """Every rank fingerprints its trained adapters for rank 0 (:meth:`compare_ranks`)."""


@dataclass
class DataParallelTraining(FusedTraining):
    """FusedTraining over the ranks of ``world`` (the default process group)."""

    world: World = field(default_factory=lambda: World(0, 1))
    heartbeat_s: float = HEARTBEAT_S
    decode: LocalDecode | None = None  # set when the ranks share the rollouts

    def __post_init__(self) -> None:
        super().__post_init__()
        self._synced: dict[str, int] = {}  # adapter -> slot, as last broadcast from rank 0
        self._lock = threading.RLock()  # one sequence of collectives at a time (rank 0)
        self._last_sent = time.monotonic()

    # ---- rank 0 ----------------------------------------------------------------------

    def train(self, rows: list[TrainRow], losses: dict[str, PolicyLoss]) -> dict[str, TrainOutcome]:
        self._require_leader("train")
        slots = {e: self.model.slot_of(e) for e in losses}
        new = self._unsynced(slots)
        with self._lock:  # the message and the phase's collectives, uninterrupted
            self._send(TrainMessage(rows, losses, slots, new, self.recompute_old_logprobs))
            return self._apply(rows, losses, slots, new)

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[Completion]:
        """Decode ``requests`` over the ranks; every rank's completions, in order."""
        self._require_leader("drive rollouts")
        if self.decode is None:
            raise RuntimeError("rank 0 has no decode set: the engine sets it")
        shares = split_rollout(requests, self.world.size)
        streams, generators = rollout_shares.stream_ids(requests)
        with self._lock:  # the message and the phase's collectives, uninterrupted
            slots = self.model.adapters()
            new = self._unsynced(slots)
            self._send(RolloutMessage(rollout_shares.to_wire(requests, shares), slots, new))
            self._sync_new(new)
            done = self.decode([requests[i] for i in shares[0]])
            mine = rollout_shares.share_result(shares[0], done, streams, generators)
            results = self._gather(mine)
        assert results is not None
        return rollout_shares.merge(results, len(requests), generators)

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

    def adapter_added(self, name: str) -> None:
        """Rank 0 just loaded ``name`` (the caller holds the engine's model lock): the
        workers add it to the same slot; its tensors go with its first train phase."""
        self._require_leader("add adapters")
        slot = self.model.slot_of(name)
        with self._lock:
            self._synced.pop(name, None)  # a re-added name is new: broadcast it again
            self._send(
                AddAdapter(name, slot, self.model.config_of(name), self.optimizer.settings[slot])
            )

    def adapter_removed(self, name: str, slot: int) -> None:
        """Rank 0 just unloaded ``name`` from ``slot``: the workers free it too."""
        self._require_leader("remove adapters")
        with self._lock:
            self._synced.pop(name, None)
            self._send(RemoveAdapter(name, slot))

    def heartbeat(self) -> bool:
        """Called by an idle rank 0: a :class:`Heartbeat` if nothing was sent for
        ``heartbeat_s``; True if one was. A dead worker fails it (a closed connection)."""
        self._require_leader("send heartbeats")
        with self._lock:
            if time.monotonic() - self._last_sent < self.heartbeat_s:
                return False
            self._send(Heartbeat())
            return True

    def compare_ranks(self) -> list[str]:
        """Whether every rank holds rank 0's trained adapters bit for bit (slot, step,
        weights, Adam moments): the disagreements, one line each; [] when they agree."""
        self._require_leader("compare the ranks")
        with self._lock:
            self._send(CompareAdapters())
            ours, *others = distributed.gather_objects(self.fingerprints())
        return [
            f"rank {rank}: {name}: {theirs.get(name)} (rank 0: {ours.get(name)})"
            for rank, theirs in enumerate(others, start=1)
            for name in sorted(set(ours) | set(theirs))
            if theirs.get(name) != ours.get(name)
        ]

    def fingerprints(self) -> dict[str, tuple[int, int, str]]:
        """Each adapter trained since its add: (slot, step, sha256 of its tensors)."""
        out = {}
        for name in sorted(self._synced):
            slot = self.model.slot_of(name)
            digest = hashlib.sha256()
            tensors = list(self.model.adapter_views(name).values())
            for moments in (self.optimizer.exp_avg, self.optimizer.exp_avg_sq):
                tensors += self.model.adapter_views(name, moments.__getitem__).values()
            for t in tensors:
                digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            out[name] = (slot, self.optimizer.steps[slot], digest.hexdigest()[:16])
        return out

    def stop(self) -> None:
        """Release the workers: they leave follow() and exit."""
        if self.world.is_leader:
            with self._lock:
                self._send(None)

    def _send(self, msg: Any) -> None:
        distributed.broadcast_object(msg, self.device)
        self._last_sent = time.monotonic()

    def _require_leader(self, what: str) -> None:
        if not self.world.is_leader:
            raise RuntimeError(f"only rank 0 may {what}; workers follow()")

    # ---- workers ---------------------------------------------------------------------

    def follow(self) -> int:
        """Run rank 0's messages until it stops; returns how many train phases ran."""
        if self.world.is_leader:
            raise RuntimeError("rank 0 drives the tick; only workers follow()")
        handlers = self.message_handlers()
        phases = 0
        while (msg := distributed.broadcast_object(None, self.device)) is not None:
            handler = handlers.get(type(msg))
            if handler is None:
                raise RuntimeError(
                    f"rank {self.world.rank}: rank 0 sent a {type(msg).__name__}, which this "
                    "rank cannot run (every rank must run the same loraplex-engine)"
                )
            handler(msg)
            phases += isinstance(msg, TrainMessage)
        return phases

    def message_handlers(self) -> dict[type, Callable[[Any], None]]:
        """What a worker does with each kind of message from rank 0 (one entry a kind)."""
        return {
            TrainMessage: self._on_train,
            RolloutMessage: self._on_rollout,
            AddAdapter: self._on_add,
            RemoveAdapter: self._on_remove,
            Heartbeat: lambda _msg: None,
            CompareAdapters: lambda _msg: distributed.gather_objects(self.fingerprints()),
        }

    def _on_train(self, msg: TrainMessage) -> None:
        self._check_adapters(msg)
        # Else the ranks' old log-probs would disagree (a sharded base's would hang).
        if msg.rescore != self.recompute_old_logprobs:
            raise RuntimeError(
                f"rank {self.world.rank}: rank 0 {'re' if msg.rescore else 'does not re'}scores "
                "the sampled rows and this rank does not agree: every rank must run the same "
                "--rollout-backend"
            )
        self.model.train()
        try:
            self._apply(msg.rows, msg.losses, msg.slots, msg.new)
        finally:
            self.model.eval()

    def _on_rollout(self, msg: RolloutMessage) -> None:
        """Decode this rank's share of rank 0's rollout and send it back."""
        if self.decode is None:
            raise RuntimeError(f"rank {self.world.rank}: a rollout came, but no decode is set")
        self._check_adapters(msg)
        self._sync_new(msg.new)
        requests, generators = rollout_shares.from_wire(msg.batch)
        mine = msg.batch.shares[self.world.rank]
        done = self.decode([requests[i] for i in mine])
        self._gather(rollout_shares.share_result(mine, done, msg.batch.streams, generators))

    def _gather(self, result: ShareResult) -> list[ShareResult] | None:
        """Every rank's result on rank 0 (None elsewhere)."""
        box: list[Any] | None = [None] * self.world.size if self.world.is_leader else None
        dist.gather_object(result, box, dst=0)
        return box

    def _on_add(self, msg: AddAdapter) -> None:
        slot = self.model.add_adapter(msg.name, msg.config)
        if slot != msg.slot:  # adds and removes replayed in rank 0's order: cannot differ
            self.model.remove_adapter(msg.name)
            raise RuntimeError(
                f"rank {self.world.rank}: adapter {msg.name!r} went to slot {slot} here but "
                f"slot {msg.slot} on rank 0"
            )
        self.optimizer.add_adapter(msg.name, msg.settings)
        self._synced.pop(msg.name, None)
        log.info("rank %d: added adapter %s in slot %d", self.world.rank, msg.name, slot)

    def _on_remove(self, msg: RemoveAdapter) -> None:
        slot = self.model.adapters().get(msg.name)
        if slot != msg.slot:
            raise RuntimeError(
                f"rank {self.world.rank}: rank 0 removed adapter {msg.name!r} from slot "
                f"{msg.slot} but here it is in {slot}"
            )
        self.optimizer.remove_adapter(msg.name)
        self.model.remove_adapter(msg.name)
        self._synced.pop(msg.name, None)
        log.info("rank %d: removed adapter %s from slot %d", self.world.rank, msg.name, slot)

    def _check_adapters(self, msg: TrainMessage | RolloutMessage) -> None:
        """This worker holds every adapter in rank 0's slot, and new ones as rank 0 built
        them (same rank and targets: the tensors about to be broadcast fit)."""
        mine = self.model.adapters()
        for name, slot in msg.slots.items():
            if mine.get(name) != slot:
                raise RuntimeError(
                    f"rank {self.world.rank}: adapter {name!r} is in slot {slot} on rank 0 "
                    f"but {mine.get(name)} here: rank 0's adds must reach every rank"
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
        losses: dict[str, PolicyLoss],
        slots: dict[str, int],
        new: dict[str, NewAdapter],
    ) -> dict[str, TrainOutcome]:
        if not slots:  # nothing to train (the tick does not call; kept in step anyway)
            return {}
        self._sync_new(new)
        share = split_rows_by_rank(rows, self.world.size)[self.world.rank]
        # A vLLM rollout: each rank scores its own share with the adapters as they are
        # (equal on every rank), exactly what one rank would compute for those rows.
        share, gaps = self.rescore(share)
        self.optimizer.zero_grad()
        stats = self.backward(share, losses, count_rows(rows))
        in_play = slice(min(slots.values()), max(slots.values()) + 1)
        distributed.all_reduce_lora_grads(self.optimizer.params, in_play)
        # One gather: every rank's gap and TIS totals over its share, which rank 0 adds
        # up (a worker's TIS tokens count only where its losses applied TIS).
        parts = distributed.gather_objects(StepTotals.of(gaps, stats))
        return with_totals(self.step_finite(list(losses)), parts)

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


def data_parallel_trainer(
    world: World, train_mode: str, lockstep: Lockstep | None = None
) -> functools.partial[FusedTraining]:
    """The Engine's training strategy class for ``world`` (``lockstep``: a sharded base)."""
    check_train_mode(world.size, train_mode)
    return functools.partial(DataParallelTraining, world=world, lockstep=lockstep)


def share_rollouts(strategy: object, backend: RolloutBackend) -> DataParallelTraining | None:
    """An engine's ranks: its training strategy when data parallel (None otherwise),
    wired so that rank 0's torch rollouts are decoded over every rank (``rollout``, each
    rank's share by its own ``generate_local``)."""
    if not isinstance(strategy, DataParallelTraining):
        return None
    if isinstance(backend, TorchRollout):
        backend.distribute = strategy.rollout
        strategy.decode = backend.generate_local
    return strategy
