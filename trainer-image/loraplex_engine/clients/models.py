"""The engine's client models: created, queued on, saved, loaded and unloaded here; run
by the tick (clients/ticking.py). Implements ``training_service.TrainingService``: the
Tinker layer is handed the Engine's ``clients``.

A client model is an adapter in the engine's slot pool like an experiment's: the same
``MultiLoRAModel`` slots, per-adapter AdamW state, capacity count, tick and checkpoint
volume (with its namespace's quota). Identity is (namespace, model id): any call naming
a model, path or sampler of another namespace finds nothing (``NotFoundError``).

The engine's parts it uses come by name in a ``ClientParts`` (clients/parts.py).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from loraplex_engine.clients import saved, share, taking
from loraplex_engine.clients.calls import queued_call
from loraplex_engine.clients.checkpoints import ClientCheckpoints, Found
from loraplex_engine.clients.gather import first_arrived, waiting_on
from loraplex_engine.clients.inputs import Limits
from loraplex_engine.clients.line import TurnLine
from loraplex_engine.clients.ops import DETACHED_KINDS, ClientModel, Op, adapter_name
from loraplex_engine.clients.parts import ClientParts
from loraplex_engine.clients.sampling import SampleTask, check_sample_call
from loraplex_engine.clients.ticking import ClientTick
from loraplex_engine.plan.client import client_lora_config
from loraplex_engine.spec.api_types import CheckpointRef
from loraplex_engine.spec.errors import (
    AdapterError,
    ConflictError,
    InvalidRequestError,
    NoCapacityError,
    NoFreeSlotError,
    NotFoundError,
    UnavailableError,
)
from loraplex_engine.spec.training_service import (
    AdamStep,
    Adoption,
    ClientDatum,
    ClientLora,
    ClientModelInfo,
    Forward,
    ForwardOutput,
    LoadState,
    LossCall,
    ModelCall,
    OptimStep,
    SampleCall,
    SampleOutput,
    SavedState,
    SaveState,
    Unload,
)
from loraplex_engine.store import checkpoint as ckpt
from loraplex_engine.tenancy.client_share import ClientShare, Lanes
from loraplex_engine.train.optim import AdamWSettings
from loraplex_engine.versions import names

# Tinker's AdamParams defaults until the first optim_step configures the model's own.
DEFAULT_ADAM = AdamWSettings(lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
UNBOUNDED = 1 << 62  # a registry without an engine (unit tests): no ceiling


class ClientModels:
    def __init__(
        self,
        parts: ClientParts | None,
        models_per_tick: int | None = None,
        gather_s: float = 0.0,
        per_namespace: int | None = None,
    ) -> None:
        self._parts = parts  # None: a registry without an engine (unit tests)
        # ClientExperiments.adoptable, handed in by the engine (clients/experiments.py).
        self.adoptions: Callable[[str, str], Adoption | None] = lambda namespace, model_id: None
        # At most this many client models of one namespace (None: share.py's default).
        self.per_namespace = per_namespace
        # At most this many models' segments a tick (None: all), taken in turn.
        self.models_per_tick = models_per_tick
        # At most this many this tick, when adapters are paged: the slots the engine
        # gives the tick's client models (tick/working_set.py); None: no bound.
        self.room: int | None = None
        # How long, at most, a queued call waits for others on their way (gather.py).
        self.gather_s = gather_s
        self._lock = threading.Lock()  # the registry and the queues
        self._queued = threading.Condition(self._lock)  # a call was queued
        self._served_last: set[ClientModel] = set()  # by the last tick that took any
        self._models: dict[tuple[str, str], ClientModel] = {}
        self._line = TurnLine()  # turn order, and which models have calls queued (line.py)
        self._samples: list[Op] = []
        self._refusing: str | None = None
        # Client work a tick takes, across namespaces (tenancy/client_share.py).
        self.share = ClientShare((parts.max_step_tokens if parts else None) or UNBOUNDED)
        self.checkpoints = ClientCheckpoints(lambda: self.parts)  # clients/checkpoints.py

    @property
    def parts(self) -> ClientParts:
        if self._parts is None:
            raise UnavailableError("this registry has no engine")
        return self._parts

    # ---- the registry -------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.parts.model_name

    def adoptable(self, namespace: str, model_id: str) -> Adoption | None:
        return self.adoptions(namespace, model_id)

    def adapter_names(self) -> list[str]:
        with self._lock:
            return [m.name for m in self._models.values()]

    def loaded(self, namespace: str, model_id: str) -> ClientModel | None:
        with self._lock:
            return self._models.get((namespace, model_id))

    def _get(self, namespace: str, model_id: str) -> ClientModel:
        model = self.loaded(namespace, model_id)
        if model is None:
            raise NotFoundError(f"no model {model_id!r}")
        return model

    def model_info(self, namespace: str, model_id: str) -> ClientModelInfo:
        return self._get(namespace, model_id).info

    def list_models(self, namespace: str) -> list[ClientModelInfo]:
        with self._lock:
            return [m.info for (ns, _), m in sorted(self._models.items()) if ns == namespace]

    def decode(self, ids: list[int]) -> str:
        return self.parts.codec.decode(ids)

    @property
    def limits(self) -> Limits:
        h = self.parts
        return Limits(h.model.base_model.config.vocab_size, h.context_tokens, h.max_step_tokens)

    # ---- creating ---------------------------------------------------------------------

    def create_model(self, namespace: str, model_id: str, lora: ClientLora) -> ClientModelInfo:
        h = self.parts
        if not saved.valid_name(model_id):
            raise InvalidRequestError(
                f"model id {model_id!r} is not a valid name", field="model_id"
            )
        if not h.one_rank_torch:
            raise UnavailableError(
                "client-driven training needs a one-rank engine with the torch rollout"
            )
        config, granted = client_lora_config(lora, h.plan_limits)  # plan/client.py
        with h.model_lock:
            with self._lock:
                if (namespace, model_id) in self._models:
                    raise ConflictError(f"model {model_id!r} exists")
                held = sum(ns == namespace for ns, _ in self._models)
                share.check(namespace, held, h.pager.max_registered, self.per_namespace)
            name = adapter_name(namespace, model_id)
            if not h.pager.has_room():
                raise NoCapacityError(f"all {h.pager.max_registered} adapters are registered")
            h.pager.check_registration(namespace)  # its spilled pages within its quota
            info = ClientModelInfo(model_id, namespace, h.model_name, h.tokenizer_id, granted)
            model = ClientModel(info, name)
            try:  # a free slot, else a fresh page its first tick pages in (no page-out here)
                h.pager.add(name, config, lora.seed, DEFAULT_ADAM, model, namespace)
            except NoFreeSlotError as e:
                raise NoCapacityError(str(e)) from e
            except AdapterError as e:
                raise InvalidRequestError(str(e), field="lora_config") from e
            with self._lock:
                self._enroll(model)
            return info

    def _enroll(self, model: ClientModel) -> None:
        """Register ``model`` at the back of the line (the caller holds the lock)."""
        self._models[(model.info.namespace, model.info.model_id)] = model
        self._line.join(model)
        if model.queue:  # calls queued already (tests build models so)
            self._line.queued(model)

    def create_model_from_state(
        self, namespace: str, model_id: str, path: str, with_optimizer: bool
    ) -> ClientModelInfo:
        stored = self.find_state(namespace, saved.parse_path(path)).info
        info = self.create_model(namespace, model_id, stored.lora)
        model = self._get(namespace, model_id)
        with self.parts.model_lock:
            try:
                self.load_into(model, path, with_optimizer)
            except BaseException:
                self.unload_now(model, save=False)
                raise
        return info

    # ---- queued calls -----------------------------------------------------------------

    def submit(
        self,
        namespace: str,
        model_id: str,
        call: ModelCall,
        order: int | None = None,
        *,
        detached: bool = True,
    ) -> Op:
        """Check ``call`` and queue it on the model (TrainingService.submit): the model's
        one queue orders its calls, by ``order`` then arrival among those not taken yet.
        ``detached``: its caller fetches a training call's answer later and says so
        (``retrieved``), as the Tinker layer does."""
        self._get(namespace, model_id)  # a model of another namespace: before any check
        state = partial(self.find_state, namespace)  # NotFoundError before queueing
        kind, payload = queued_call(call, self.limits, state)
        op = Op(kind, payload, order=order, detached=detached and kind in DETACHED_KINDS)
        with self._lock:
            model = self._models.get((namespace, model_id))
            if model is None:
                raise NotFoundError(f"no model {model_id!r}")
            if self._refusing is not None:
                raise UnavailableError(self._refusing)
            model.put(op)
            self._line.queued(model)
            model.last_call = op.queued_at
            self._queued.notify_all()
        self.parts.wake()
        return op

    # Blocking forms (the engine's own callers and tests): submitted, then waited for.

    def forward(
        self, namespace: str, model_id: str, data: list[ClientDatum], loss: LossCall
    ) -> ForwardOutput:
        return self.submit(namespace, model_id, Forward(data, loss), detached=False).wait()

    def forward_backward(
        self, namespace: str, model_id: str, data: list[ClientDatum], loss: LossCall
    ) -> ForwardOutput:
        call = Forward(data, loss, backward=True)
        return self.submit(namespace, model_id, call, detached=False).wait()

    def optim_step(self, namespace: str, model_id: str, adam: AdamStep) -> dict[str, float]:
        return self.submit(namespace, model_id, OptimStep(adam), detached=False).wait()

    def save_state(
        self, namespace: str, model_id: str, name: str, kind: saved.Kind, ttl_s: float | None = None
    ) -> SavedState:
        return self.submit(namespace, model_id, SaveState(name, kind, ttl_s)).wait()

    def load_state(self, namespace: str, model_id: str, path: str, with_optimizer: bool) -> None:
        self.submit(namespace, model_id, LoadState(path, with_optimizer)).wait()

    def unload_model(self, namespace: str, model_id: str, save: bool = True) -> None:
        self.submit(namespace, model_id, Unload(save)).wait()

    def sample(self, namespace: str, sampler: str, call: SampleCall) -> SampleOutput:
        h = self.parts
        state, version = None, None
        ref = names.parse(names.untinkered(sampler))
        if ref is not None:  # a published version or alias (versions/), the caller's own
            if ref.namespace != namespace:
                raise NotFoundError(f"no model {sampler!r} in namespace {namespace!r}")
            version = h.publisher.serving(names.untinkered(sampler))
        elif sampler != h.model_name:
            state = saved.parse_path(sampler, field="model_path")
            if state.kind != "sampler_weights":
                raise InvalidRequestError(
                    "sample from a sampler_weights path or the base model", field="model_path"
                )
            self.find_state(namespace, state)  # NotFoundError before queueing
        check_sample_call(call, self.limits)
        h.work_limits.check_completion(len(call.prompt_ids), call.max_tokens, call.num_samples)
        op = Op("sample", SampleTask(namespace, state, call, version=version))
        with self._lock:
            if self._refusing is not None:
                raise UnavailableError(self._refusing)
            self._samples.append(op)
        h.wake()
        return op.wait()

    def list_saved(self, namespace: str, model_id: str | None = None) -> list[SavedState]:
        return self.checkpoints.listed(namespace, model_id)

    def find_saved(self, namespace: str, path: str) -> SavedState:
        return self.checkpoints.saved_state(namespace, saved.parse_path(path, "model_path"))

    def delete_saved(self, namespace: str, path: str) -> None:
        self.checkpoints.delete(namespace, path)

    def set_saved_ttl(self, namespace: str, path: str, ttl_s: float | None) -> None:
        self.checkpoints.set_ttl(namespace, path, ttl_s)

    def saved_files(self, namespace: str, path: str) -> dict[str, Path]:
        return self.checkpoints.files(namespace, path)

    # ---- the tick's side --------------------------------------------------------------

    def held_until(self) -> float | None:
        """With calls queued that the fair share holds back, when it may take them with no
        new call arriving (ClientShare.settles_at); None when nothing waits on that."""
        with self._lock:
            queued = any(any(lanes) for lanes in self._lanes().values())
            return self.share.settles_at(time.monotonic()) if queued else None

    def has_work(self, reference: int | None = None) -> bool:
        """The next training tick would take a call (tick/time_share.py): the fair
        share may hold a dear namespace's calls back (tenancy/client_share.py)."""
        with self._lock:
            return bool(self.share.plan(self._lanes(), reference, time.monotonic()).taken)

    def gather(self, clock: Callable[[], float] = time.monotonic) -> None:
        """Before a tick: wait until every model on its way (gather.waiting_on) has its
        call queued, or until ``gather_s`` after the oldest call the tick would take
        arrived, whichever is first; at once when it would take none or none is on its
        way. Calls the fair share holds back (tenancy/client_share.py) neither set the
        window nor are waited for: they wait anyway. Holds no engine lock: calls queue
        meanwhile."""
        if self.gather_s <= 0:
            return
        with self._queued:
            while True:
                taken = self.share.plan(self._lanes(), None, clock()).taken
                oldest = first_arrived(op for w in taken for op in w.item.ops)
                models = self._line.in_turn({*self._line.waiting(), *self._served_last})
                on_way = waiting_on(models, self._served_last, self.models_per_tick)
                if oldest is None or not on_way:
                    return
                left = oldest + self.gather_s - clock()
                if left <= 0:
                    return
                self._queued.wait(left)

    def take(self, train: bool = True, reference: int | None = None) -> ClientTick:
        """This tick's work, as the fair share takes it across namespaces
        (tenancy/client_share.py; ``reference``: the cheapest running experiment's step
        cost): of each model a prefix of its first segment, of at most
        ``models_per_tick`` models in turn (a model taken goes to the back of the line),
        and sample calls; none for a serving tick (a client's calls, its samples too, are
        its training loop's)."""
        if not train:
            return ClientTick(self, [], [])
        with self._lock:
            taken = self.share.take(self._lanes(), reference, time.monotonic())
            segments, samples = taking.pop(taken)
            for model, ops in segments:
                model.outstanding += sum(op.detached for op in ops)
            gone = {id(op) for op in samples}
            self._samples = [op for op in self._samples if id(op) not in gone]
            if segments:
                self._served_last = {m for m, _ in segments}
            if self.models_per_tick is not None or self.room is not None:
                for model, _ in segments:
                    self._line.to_back(model)
        return ClientTick(self, segments, samples)

    def late_steps(
        self,
        segments: list[tuple[ClientModel, list[Op]]],
        clock: Callable[[], float] = time.monotonic,
    ) -> list[tuple[ClientModel, Op]]:
        """At the tick's step phase: the optim_steps that arrived for its open segments
        while it ran (taking.late_steps) join it; for those still open it waits, until
        ``gather_s`` after the step phase began (the forward_backward's answer is given).
        The window runs from here, not from the forward_backward's arrival: the gather
        and the pass spend that one (always, with several clients), and an optim_step the
        SDK sends once its forward_backward is acknowledged, behind the other clients'
        calls, then missed the tick and made one of its own."""
        late: list[tuple[ClientModel, Op]] = []
        until = clock() + self.gather_s
        with self._queued:
            while True:
                for model, op in taking.late_steps(segments):
                    model.outstanding += op.detached
                    late.append((model, op))
                if not taking.still_open(segments) or until <= clock():
                    return late
                self._queued.wait(until - clock())

    def _lanes(self) -> Lanes[taking.Taken]:
        models = self._line.waiting()
        caps = [c for c in (self.models_per_tick, self.room) if c is not None]
        if caps:
            models = models[: min(caps)]
        return taking.lanes(models, self._samples)

    def demand(self) -> tuple[int, bool]:
        """Models with a call queued, and whether a sample call waits (paging's share)."""
        with self._lock:
            return len(self._line.waiting()), bool(self._samples)

    def waiting_names(self) -> list[str]:
        """The adapters of the models with calls queued, in turn order (a prefetch's
        guess at the next tick: memory/prefetch.py)."""
        with self._lock:
            return [m.name for m in self._line.waiting()]

    def retrieved(self, namespace: str, model_id: str) -> None:
        """A detached call's answer was fetched (the Tinker layer's retrieve_future):
        once its client holds every answer, its next call is on its way (gather.py)."""
        with self._queued:
            model = self._models.get((namespace, model_id))
            if model is not None and model.outstanding:
                model.outstanding -= 1
                self._queued.notify_all()

    def refuse(self, reason: str) -> None:
        """No tick will run again: answer every queued call, and every later one."""
        with self._lock:
            self._refusing = reason
            ops = [op for m in self._models.values() for op in m.queue] + self._samples
            for m in self._models.values():
                m.queue.clear()
            self._samples = []
        for op in ops:
            op.resolve(error=UnavailableError(reason))

    def find_state(self, namespace: str, state: saved.StatePath) -> Found:
        return self.checkpoints.find(namespace, state)

    def save(
        self, model: ClientModel, name: str, kind: saved.Kind, ttl_s: float | None = None
    ) -> SavedState:
        """The model's state under the caller's namespace (clients/checkpoints.py)."""
        return self.checkpoints.save(model, name, kind, ttl_s)

    def load_into(self, model: ClientModel, path: str, with_optimizer: bool) -> None:
        """Weights (and with ``with_optimizer`` the optimiser state of a ``weights``
        state) of the caller's namespace into ``model``; its gradient is cleared."""
        h = self.parts
        found = self.find_state(model.info.namespace, saved.parse_path(path))
        config = found.config
        h.pager.page_in(model.name)  # registered with every slot taken: its first one now
        if config != h.model.config_of(model.name):
            raise InvalidRequestError(
                f"{path} holds rank {config.rank} on {list(config.target_modules)}; this model "
                f"has rank {model.info.lora.rank}",
                field="path",
            )
        found.load_weights(h.model, model.name)
        if with_optimizer and found.directory is not None and found.info.kind == "weights":
            ckpt.load_trainer_state(
                found.directory, h.optimizer, model.name, model.generator, False
            )
        else:
            h.optimizer.add_adapter(model.name, DEFAULT_ADAM)
        model.grads = None
        model.version += 1

    def stepped(self, model: ClientModel) -> None:
        """After an optimiser step (in the tick, before the step's call is answered): a
        client experiment's checkpoint when one is due, the oldest beyond ``keep``
        removed, so a step its client saw done is on the volume."""
        model.steps += 1
        every, keep = model.checkpoints
        if not every or model.steps % every:
            return
        name = f"step-{model.steps:08d}"
        state = self.save(model, name, "weights")
        if model.on_checkpoint is not None:
            model.on_checkpoint(CheckpointRef(path=state.path, step=model.steps))
        info = model.info
        steps = sorted(
            s.name
            for s in saved.list_saved(self.parts.root, info.namespace, info.model_id)
            if s.kind == "weights" and s.name.startswith("step-")
        )
        for old in steps[: max(0, len(steps) - keep)]:
            target = saved.StatePath(info.model_id, "weights", old)
            shutil.rmtree(target.directory(self.parts.root, info.namespace), True)

    def unload_now(self, model: ClientModel, save: bool = True) -> None:
        """Free its slot (under the model lock), its last weights saved as
        ``weights/loraplex-final`` first when ``save``; calls still queued get NotFoundError."""
        h = self.parts
        if save:
            h.pager.page_in(model.name)  # paged out: back in its slot, to be saved
            self.save(model, saved.engine_name("final"), "weights")
        with self._lock:
            self._models.pop((model.info.namespace, model.info.model_id), None)
            self._line.leave(model)
            left, model.unloaded = list(model.queue), True
            model.queue.clear()
        h.pager.discard(model.name)  # its slot, or its page (no page-in to drop it)
        for op in left:
            op.resolve(error=NotFoundError(f"model {model.info.model_id!r} was unloaded"))
