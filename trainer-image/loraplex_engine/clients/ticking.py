"""What one tick does for the client models (engine.py calls it under the model lock):

1. ``start`` (before the rollout): each sample call gets its adapter (the live slot or
   a spare one holding the published version) and its prompt log-probs; its rows join
   the tick's rollout batch as completion jobs.
2. ``ride`` (before the update): the taken ``forward``/``forward_backward`` calls join
   the experiments' update as riders (train/riders.py): one micro-batch plan, one
   forward and backward for both kinds; ``train`` (after it) takes each model's
   gradient into its accumulator (a pass of their own if no experiment trained), then
   runs the ``optim_step``\\ s (clients/fused.py).
3. ``finish``: saves, loads and unloads, in each model's call order; the sample answers;
   the spare slots freed.

Each model contributes one *segment* of its queue a tick (clients/ops.py), so its
operations run in call order; different models' segments share the tick. An operation
that fails answers its caller alone; a fault of the shared pass answers every operation
this tick took with ``UnavailableError`` (``fail``) and the tick fails as it does for
experiments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from loraplex_engine.clients.checkpoints import Found
from loraplex_engine.clients.fused import StepCall, optim_steps, take_slot_grads
from loraplex_engine.clients.ops import ClientModel, Op
from loraplex_engine.clients.parts import ClientParts
from loraplex_engine.clients.sampling import SampleTask, prompt_logprobs
from loraplex_engine.clients.saved import StatePath
from loraplex_engine.completion_jobs import CompletionJob
from loraplex_engine.spec.errors import ConflictError, UnavailableError
from loraplex_engine.store.spare_slots import SpareSlots
from loraplex_engine.train.riders import TrainCall
from loraplex_engine.train.strategy import AdapterTrainer, FusedTraining, TrainingStrategy

log = logging.getLogger("loraplex_engine.clients")


class Owner(Protocol):
    """What the tick needs of the registry (clients/models.ClientModels)."""

    @property
    def parts(self) -> ClientParts: ...

    def decode(self, ids: list[int]) -> str: ...

    def loaded(self, namespace: str, model_id: str) -> ClientModel | None: ...

    def find_state(self, namespace: str, state: StatePath) -> Found: ...

    def save(self, model: ClientModel, name: str, kind: Any) -> Any: ...

    def load_into(self, model: ClientModel, path: str, with_optimizer: bool) -> None: ...

    def unload_now(self, model: ClientModel, save: bool = True) -> None: ...

    def stepped(self, model: ClientModel) -> None: ...

    def late_steps(
        self, segments: list[tuple[ClientModel, list[Op]]]
    ) -> list[tuple[ClientModel, Op]]: ...


@dataclass
class ClientTick:
    owner: Owner
    segments: list[tuple[ClientModel, list[Op]]]
    samples: list[Op]
    spare: SpareSlots | None = None  # ~sample adapters loaded this tick
    calls: list[tuple[ClientModel, Op, TrainCall]] = field(default_factory=list)
    resident: Any = None  # the VersionSlots that served published versions this tick

    def __bool__(self) -> bool:
        return bool(self.segments or self.samples)

    def ops(self) -> list[Op]:
        return [op for _, ops in self.segments for op in ops] + self.samples

    def slot_names(self) -> list[str]:
        """The adapters this tick reads: every model taken, but one whose only calls are
        unloads without a save (its page is dropped, never paged in to be dropped)."""
        return [
            m.name
            for m, ops in self.segments
            if not all(op.kind == "unload" and op.payload is False for op in ops)
        ]

    # ---- 1. before the rollout ----------------------------------------------------------

    def start(self) -> list[CompletionJob]:
        jobs = []
        for op in self.samples:
            task: SampleTask = op.payload
            try:
                task.adapter = self._adapter_for(task)
                if task.call.prompt_logprobs or task.call.topk_prompt_logprobs:
                    parts = self.owner.parts
                    slot = 0 if task.adapter is None else parts.model.slot_of(task.adapter)
                    task.prompt_logprobs, task.topk = prompt_logprobs(
                        parts.model, parts.device, slot, task.call.prompt_ids,
                        task.call.topk_prompt_logprobs, task.call.prompt_logprobs_last_n,
                    )  # fmt: skip
                jobs.append(task.completion_job(self.owner.parts.model_name, self.owner.decode))
            except Exception as e:
                op.resolve(error=e)
        self.ride()
        return jobs

    def _adapter_for(self, task: SampleTask) -> str | None:
        if task.version is not None:  # a published version: resident (versions/slot_cache.py)
            slots = self.owner.parts.publisher.slots
            if slots is not None:
                self.resident = slots
                return slots.load(*task.version, task.version[0])
            if self.spare is None:
                self.spare = SpareSlots(self.owner.parts.model)
            return self.spare.load(*task.version, task.version[0])
        if task.state is None:
            return None
        found = self.owner.find_state(task.namespace, task.state)
        info = found.info
        live = self.owner.loaded(task.namespace, task.state.model_id)
        paged = live is not None and self.owner.parts.pager.is_paged(live.name)
        if (
            live is not None
            and not paged
            and (live.incarnation, live.version)
            == (
                info.incarnation,
                info.version,
            )
        ):
            return live.name
        if self.spare is None:
            self.spare = SpareSlots(self.owner.parts.model)
        name = f"~sample:{task.namespace}/{task.state.uri}"
        if found.snapshot is not None:  # held in memory (clients/sampler_cache.py)
            snap = found.snapshot
            return self.spare.load_state(name, snap.config, snap.tensors, task.state.uri)
        assert found.directory is not None
        return self.spare.load(name, found.directory, task.state.uri)

    # ---- 2. the train phase -------------------------------------------------------------

    def ride(self) -> None:
        """Before the tick's update: its train calls ride it (train/riders.py), so the
        experiments' rows and theirs run in one pass; ``train`` runs them on their own
        when no update took them (no experiment trained this tick)."""
        self.calls = []
        parts = self.owner.parts
        for model, ops in self.segments:
            for op in ops:
                if op.kind in ("forward", "forward_backward"):
                    call = TrainCall(parts.model.slot_of(model.name), *op.payload)
                    self.calls.append((model, op, call))
        strategy = parts.strategy
        if self.calls and isinstance(strategy, FusedTraining):
            strategy.riders = [c for _, _, c in self.calls]

    def train(self, strategy: TrainingStrategy) -> None:
        """The train calls' pass unless they rode the update, their gradients taken into
        each model's accumulator, then the optimiser steps: those taken, and those that
        arrived meanwhile for a segment left open (its forward_backward's optim_step,
        sent after it: taking.late_steps)."""
        parts = self.owner.parts
        calls = self.calls
        steps = [(m, op) for m, ops in self.segments for op in ops if op.kind == "optim_step"]
        if not calls and not steps:
            return
        if not isinstance(strategy, AdapterTrainer):
            raise UnavailableError("client training needs the engine's own trainer")
        if calls:
            try:
                if not all(c.outputs for _, _, c in calls):  # no update took them
                    strategy.riders = [c for _, _, c in calls]  # a pass of their own
                    parts.optimizer.zero_grad()
                    parts.model.train()
                    strategy.backward([], {})
                for model in dict.fromkeys(m for m, _, c in calls if c.backward):
                    slot = parts.model.slot_of(model.name)
                    model.grads = take_slot_grads(parts.optimizer, slot, model.grads)
            finally:
                strategy.riders = []
                parts.optimizer.zero_grad()
                parts.model.eval()
            for _, op, c in calls:
                op.resolve(c.output())
        self._steps(steps + self.owner.late_steps(self.segments))

    def _steps(self, steps: list[tuple[ClientModel, Op]]) -> None:
        parts = self.owner.parts
        todo = [
            StepCall(m.name, parts.model.slot_of(m.name), m.grads, op.payload) for m, op in steps
        ]
        metrics = optim_steps(parts.optimizer, todo)
        for model, op in steps:
            model.grads = None
            mine = metrics[model.name]
            if mine.get("skipped:sum"):
                op.resolve(error=ConflictError("the accumulated gradient is not finite: "
                                               "not stepped, and cleared"))  # fmt: skip
                continue
            model.version += 1
            try:
                self.owner.stepped(model)
            except Exception as e:  # stepped, but its checkpoint is not written: say so
                op.resolve(error=e)
                continue
            op.resolve(mine)

    # ---- 3. after the tick --------------------------------------------------------------

    def finish(self) -> None:
        try:
            for model, ops in self.segments:
                for op in ops:
                    if not op.done.is_set():
                        self._other(model, op)
            for op in self.samples:
                if not op.done.is_set():
                    try:
                        op.resolve(op.payload.output())
                    except Exception as e:
                        op.resolve(error=e)
        finally:
            if self.spare is not None:
                self.spare.release()
            if self.resident is not None:
                self.resident.release()

    def _other(self, model: ClientModel, op: Op) -> None:
        try:
            if op.kind == "save_state":
                op.resolve(self.owner.save(model, *op.payload))
            elif op.kind == "load_state":
                self.owner.load_into(model, *op.payload)
                op.resolve(None)
            elif op.kind == "unload":
                self.owner.unload_now(model, save=op.payload is not False)
                op.resolve(None)
            else:
                op.resolve(error=UnavailableError(f"operation {op.kind!r} was not run"))
        except Exception as e:
            op.resolve(error=e)

    def fail(self, error: BaseException) -> None:
        """The tick failed (a fault of the shared model or device): every operation it
        took is answered."""
        why = UnavailableError(f"the tick serving this failed: {type(error).__name__}")
        for op in self.ops():
            op.resolve(error=why)
