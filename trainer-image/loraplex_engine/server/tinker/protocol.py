"""The Tinker operations over :class:`TrainingService`, apart from HTTP: each checks its
request, answers at once what it can, and puts the engine call on its model's queue
(the engine's, the one that orders the model's calls) behind a future (futures.py).

Model ids are ``<session>:train:<model_seq_id>``, the SDK's own spelling (it computes a
model's id itself when it creates a model from a checkpoint), so a resent request names
the same model. A ``(model, seq_id)`` sent twice answers the first request's future.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from loraplex_engine.server.tinker import wire
from loraplex_engine.server.tinker.completions import Completions, target_of
from loraplex_engine.server.tinker.errors import failure_text
from loraplex_engine.server.tinker.future_table import FutureTable
from loraplex_engine.server.tinker.futures import Future, Runner
from loraplex_engine.server.tinker.inflight import Inflight, check_kind, sequence_ids
from loraplex_engine.server.tinker.journal import Entry, journalled, replay
from loraplex_engine.server.tinker.sampling_params import sample_call
from loraplex_engine.server.tinker.stability import Stability
from loraplex_engine.server.tinker.state import Model, Registry, Sampler
from loraplex_engine.spec.errors import (
    ApiError,
    InvalidRequestError,
    NamespaceShareError,
    NoCapacityError,
    NotFoundError,
)
from loraplex_engine.spec.tinker_limits import RecordLimits
from loraplex_engine.spec.tinker_paths import engine_name, reserved
from loraplex_engine.spec.training_service import (
    AdamStep,
    ClientLora,
    Forward,
    LoadState,
    ModelCall,
    OptimStep,
    SavedState,
    SaveState,
    TrainingService,
    Unload,
)
from loraplex_engine.versions import names

log = logging.getLogger("loraplex_engine.server.tinker")

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
JANITOR_S = 1.0
DIMUON_REFUSAL = (
    "optimizer 'dimuon' is not supported: the tinker SDK defines only its settings "
    "(learning_rate, beta1, grad_clip_norm), not its update rule, so no implementation "
    "here could be checked to match it; this engine trains with AdamW (type 'adamw')"
)


def _raise(error: Exception) -> Any:
    raise error


def _name(value: str | None, default: str, field: str) -> str:
    if value is None:
        return default
    if not NAME.match(value):
        raise InvalidRequestError(
            "a checkpoint name is 1-128 letters, digits, '.', '_' or '-'", field=field
        )
    if reserved(value):
        raise InvalidRequestError(
            f"checkpoint names starting {engine_name('')!r} are reserved for the engine's "
            "own saves",
            field=field,
        )
    return value


class Protocol:
    def __init__(
        self,
        training: Callable[[], TrainingService],
        *,
        registry: Registry | None = None,
        futures: FutureTable | None = None,
        runner: Runner | None = None,
        janitor_s: float = JANITOR_S,
        served_names: tuple[str, ...] = (),
        unlisted_names: tuple[str, ...] = (),
        records: RecordLimits | None = None,
    ) -> None:
        self.training = training
        self.aliases = served_names  # serve --served-model-name: more names of the base
        self.unlisted = unlisted_names  # accepted, not listed: the directory's name
        self.registry = registry or Registry()
        if self.registry.adopter is None:  # client experiments' models (clients/experiments.py)
            self.registry.adopter = lambda ns, mid: self.training().adoptable(ns, mid)
            self.registry.on_adopted = lambda model, found: replay(self, model, found.steps)
        self.futures = futures if futures is not None else FutureTable()
        self.completions = Completions(self.futures)  # retrieve_futures, cancel_future
        self.inflight = Inflight()  # models' shared inflight sampler weights
        self.stability = Stability(self.registry, records)  # stable_reinforce's recordings
        self.runner = runner or Runner()
        self._stop = threading.Event()
        self._janitor = threading.Thread(
            target=self._janitor_loop, args=(janitor_s,), name="tinker-janitor", daemon=True
        )
        self._janitor.start()

    def close(self) -> None:
        self._stop.set()
        self.runner.close()

    # --- helpers ---

    def _finish(self, fut: Future, fn: Callable[[], Any]) -> None:
        try:
            fut.finish(fn())
        except Exception as e:
            fut.fail(*failure_text(e))

    def queue_call(
        self,
        model: Model,
        seq_id: int | None,
        kind: str,
        call: ModelCall,
        answer: Callable[[Any], Any],
        entry: tuple[str, bytes, str | None] | None = None,
    ) -> str:
        """A future for ``call``, put on the model's queue in the engine (ordered there by
        ``seq_id``) before this returns: the SDK sends a model's next call once this one is
        acknowledged, so its calls reach that queue in order. A pool thread waits for the
        answer and finishes the future with ``answer(result)``."""
        if seq_id is not None:  # the same request sent again: the same future
            earlier = self.registry.seq_request(model, seq_id)
            if earlier is not None and self.futures.get(model.namespace, earlier) is not None:
                return earlier
        rid = None
        if model.journal is not None and seq_id is not None and entry is not None:
            model.journal.write(Entry(seq_id, *entry))  # a client experiment's (journal.py)
            rid = f"{model.id}#{seq_id}"
        fut = self.futures.new(model.namespace, kind, model.id, rid)
        if seq_id is not None:
            self.registry.record_seq(model, seq_id, fut.request_id)
        finish = self._finish
        if rid is not None and model.journal is not None and seq_id is not None:
            finish = journalled(self._finish, model.journal, seq_id)
        try:
            pending = self.training().submit(model.namespace, model.id, call, seq_id)
        except Exception as e:  # refused at once: the future says why
            finish(fut, partial(_raise, e))
            return fut.request_id
        self.runner.submit(lambda: finish(fut, lambda: answer(pending.wait())))
        return fut.request_id

    def served_names(self) -> list[str]:
        """The base model's names, its own first (what the capabilities list)."""
        own = self.training().model_name
        return [own, *(n for n in self.aliases if n != own)]

    def _check_base(self, base_model: str | None, field: str = "base_model") -> str:
        names = self.served_names()
        if base_model is not None and base_model.split(":")[0] not in (*names, *self.unlisted):
            served = ", ".join(repr(n) for n in names)
            raise NotFoundError(
                f"base model {base_model!r} is not served here; this engine serves {served}",
                field=field,
            )
        return names[0]

    @staticmethod
    def _check_optimizer(config: dict[str, Any] | None, field: str) -> None:
        kind = (config or {}).get("type", "adamw")
        if kind == "dimuon":  # the SDK names its settings, not its update rule
            raise InvalidRequestError(DIMUON_REFUSAL, field=f"{field}.type")
        if kind != "adamw":
            raise InvalidRequestError(
                f"optimizer {kind!r} is not supported; this engine trains with AdamW",
                field=f"{field}.type",
            )

    # --- models ---

    def _create(
        self,
        namespace: str,
        session_id: str,
        model_seq_id: int,
        user_metadata: dict[str, Any] | None,
        kind: str,
        make: Callable[[str], Any],
        answer: Callable[[str, Any], dict[str, Any]],
    ) -> str:
        """A model created in the background; while the engine is full the future is
        paused for capacity and the creation retried."""
        session = self.registry.session(namespace, session_id)
        model_id = f"{session.id}:train:{model_seq_id}"
        pending = self.registry.creating(namespace, model_id)
        if pending is not None:
            return pending
        try:
            self.registry.model(namespace, model_id)
            raise InvalidRequestError(f"model {model_id} exists", field="model_seq_id")
        except NotFoundError:
            pass
        fut = self.futures.new(namespace, kind, model_id)
        self.registry.set_creating(namespace, model_id, fut.request_id)

        def attempt() -> None:
            if fut.state in ("done", "failed"):
                return
            try:
                info = make(model_id)
            except NamespaceShareError as e:  # its own share: waiting would not free it
                self.registry.set_creating(namespace, model_id, None)
                fut.fail(*failure_text(e))
                return
            except NoCapacityError as e:
                try:
                    self.registry.session(namespace, session.id)
                except ApiError as gone:
                    self.registry.set_creating(namespace, model_id, None)
                    fut.fail(*failure_text(gone))
                    return
                fut.set_state("paused_capacity")
                fut.error = e.message
                self.runner.park(attempt)
                return
            except Exception as e:
                self.registry.set_creating(namespace, model_id, None)
                fut.fail(*failure_text(e))
                return
            rank = info.lora.rank if info is not None else 0
            model = Model(model_id, namespace, session.id, rank, user_metadata)
            self.registry.set_creating(namespace, model_id, None)
            if not self.registry.add_model(model):  # the session ended meanwhile
                self._retire(model, save=False)
                fut.fail("the session ended before the model was created", "user")
                return
            fut.finish(answer(model_id, info))

        self.runner.submit(attempt)
        return fut.request_id

    def create_model(self, namespace: str, body: dict[str, Any]) -> str:
        self._check_base(body.get("base_model"))
        self._check_optimizer(body.get("optimizer_config"), "optimizer_config")
        lora = body.get("lora_config") or {}
        if "rank" not in lora:
            raise InvalidRequestError("a LoRA rank is required", field="lora_config.rank")
        client_lora = ClientLora(
            rank=int(lora["rank"]),
            seed=lora.get("seed"),
            train_attn=bool(lora.get("train_attn", True)),
            train_mlp=bool(lora.get("train_mlp", True)),
            train_unembed=bool(lora.get("train_unembed", True)),
        )
        return self._create(
            namespace,
            body["session_id"],
            int(body["model_seq_id"]),
            body.get("user_metadata"),
            "CreateModel",
            lambda mid: self.training().create_model(namespace, mid, client_lora),
            lambda mid, _: {"model_id": mid, "type": "create_model"},
        )

    def load_weights(self, namespace: str, body: dict[str, Any]) -> str:
        path = body["path"]
        optimizer = bool(body.get("optimizer", False))
        if body.get("optimizer_config") is not None:
            self._check_optimizer(body["optimizer_config"], "optimizer_config")
        answer = {"path": path, "type": "load_weights"}
        if body.get("session_id") is not None:  # create-via-load: a new model
            if body.get("base_model") is not None:
                self._check_base(body["base_model"])
            return self._create(
                namespace,
                body["session_id"],
                int(body.get("model_seq_id") or 0),
                body.get("user_metadata"),
                "LoadWeights",
                lambda mid: self.training().create_model_from_state(
                    namespace, mid, path, optimizer
                ),
                lambda mid, _: {**answer, "model_id": mid},
            )
        if body.get("model_id") is None:
            raise InvalidRequestError("model_id or session_id is required", field="model_id")
        model = self.registry.model(namespace, body["model_id"])
        call = LoadState(path, optimizer)
        done = {**answer, "model_id": model.id}
        return self.queue_call(model, body.get("seq_id"), "LoadWeights", call, lambda _: done)

    def forward_backward(self, namespace: str, body: bytes, encoding: str | None) -> str:
        svc = self.training()
        max_tokens = svc.limits.max_tokens
        raw = wire.decompress(body, encoding, wire.max_body_bytes(max_tokens))
        call = wire.read_forward_backward(raw, max_tokens)
        model = self.registry.model(namespace, call.model_id)
        data = self.stability.data(namespace, model.session_id, call)
        step = Forward(data, call.loss, backward=not call.forward_only)
        kind = "Forward" if call.forward_only else "ForwardBackward"
        entry = ("forward_backward", body, encoding)
        seq = call.seq_id or None
        return self.queue_call(model, seq, kind, step, wire.forward_output_proto, entry)

    def optim_step(self, namespace: str, body: dict[str, Any]) -> str:
        model = self.registry.model(namespace, body["model_id"])
        params = dict(
            body.get("adam_params")
            or body.get("optim_params")
            or body.get("optimizer_params")
            or {}
        )
        self._check_optimizer(params, "optim_params")
        params.pop("type", None)
        fields = AdamStep.__dataclass_fields__
        unknown = sorted(set(params) - set(fields))
        if unknown:
            raise InvalidRequestError("unknown AdamParams field", f"adam_params.{unknown[0]}")
        adam = replace(AdamStep(), **{k: float(v) for k, v in params.items()})

        seq = body.get("seq_id")

        def done(metrics: dict[str, float]) -> dict[str, Any]:
            answer = {"metrics": {k: float(v) for k, v in metrics.items()}}
            if model.journal is not None and seq is not None:  # kept, then the window moves
                model.journal.done(seq, answer)
                model.journal.stepped(seq, model.checkpoint_every)
            return answer

        entry = ("optim_step", json.dumps(body).encode(), None)
        return self.queue_call(model, seq, "OptimStep", OptimStep(adam), done, entry)

    def save_weights(self, namespace: str, body: dict[str, Any]) -> str:
        model = self.registry.model(namespace, body["model_id"])
        seq = body.get("seq_id")
        name = _name(body.get("path"), f"state-{seq or int(time.time())}", "path")

        ttl = body.get("ttl_seconds")

        def done(saved: SavedState) -> dict[str, Any]:
            return {"path": saved.path, "type": "save_weights"}

        entry = ("save_weights", json.dumps(body).encode(), None)
        call = SaveState(name, "weights", ttl)
        return self.queue_call(model, seq, "SaveWeights", call, done, entry)

    def save_weights_for_sampler(self, namespace: str, body: dict[str, Any]) -> str:
        model = self.registry.model(namespace, body["model_id"])
        inflight = check_kind(body) == "inflight"
        seq = body.get("seq_id")
        session_seq = body.get("sampling_session_seq_id")
        name = _name(body.get("path"), f"sampler-{seq or int(time.time())}", "path")
        ttl = body.get("ttl_seconds")  # held in memory, bounded (clients/sampler_cache.py)

        def done(saved: SavedState) -> dict[str, Any]:
            out = {"path": saved.path, "type": "save_weights_for_sampler"}
            if body.get("path") is None:  # save_weights_and_get_sampling_client
                session = self.registry.session(namespace, model.session_id)
                base = self.training().model_name
                shared = model.id if inflight else None
                if inflight:  # the model's inflight clients sample it from now on
                    self.inflight.publish(namespace, model.id, saved.path)
                sampler = self.registry.add_sampler(session, base, saved.path, session_seq, shared)
                out["sampling_session_id"] = sampler.id
            return out

        entry = ("save_weights_for_sampler", json.dumps(body).encode(), None)
        call = SaveState(name, "sampler_weights", ttl)
        return self.queue_call(model, seq, "SaveWeightsForSampler", call, done, entry)

    def unload_model(self, namespace: str, body: dict[str, Any]) -> str:
        model = self.registry.model(namespace, body["model_id"])

        def done(_: None) -> dict[str, Any]:
            self.registry.drop_model(model.namespace, model.id)
            self.inflight.forget(model.namespace, model.id)
            self.runner.wake()
            return {"model_id": model.id, "type": "unload_model"}

        return self.queue_call(model, body.get("seq_id"), "UnloadModel", Unload(), done)

    def _retire(self, model: Model, *, save: bool) -> None:
        """Unload a model whose client has gone, its weights saved once first when asked
        (the unload's own save: one copy, not two)."""

        def run() -> None:
            svc = self.training()
            try:
                svc.submit(model.namespace, model.id, Unload(save=save)).wait()
            except NotFoundError:
                pass
            except Exception:  # its save failed (a full quota): its slot is freed anyway
                log.exception("could not save and unload %s", model.id)
                try:
                    svc.submit(model.namespace, model.id, Unload(save=False)).wait()
                except NotFoundError:
                    pass
                except Exception:
                    log.exception("could not unload %s", model.id)
            self.registry.drop_model(model.namespace, model.id)
            self.inflight.forget(model.namespace, model.id)
            self.runner.wake()
            log.info("tinker model %s of %s unloaded: its session ended", model.id, model.namespace)

        self.runner.submit(run)

    def end_session(self, namespace: str, session_id: str) -> None:
        for model in self.registry.end_session(namespace, session_id):
            self._retire(model, save=True)
        self.stability.end_session(namespace, session_id)

    def _janitor_loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self.futures.sweep()
                self.stability.sweep()
                for model in self.registry.expired():
                    self._retire(model, save=True)
            except Exception:
                log.exception("tinker janitor failed")

    # --- sampling ---

    def create_sampler(self, namespace: str, body: dict[str, Any]) -> Sampler:
        session = self.registry.session(namespace, body["session_id"])
        base = self._check_base(body.get("base_model"))
        path = body.get("model_path")
        if path is not None:
            self.check_sampler_path(namespace, path)
        return self.registry.add_sampler(session, base, path, body.get("sampling_session_seq_id"))

    def check_sampler_path(self, namespace: str, path: str) -> None:
        version = names.parse(names.untinkered(path))  # a published version (versions/)
        if version is not None:
            if version.namespace != namespace:
                raise NotFoundError(
                    f"no model {path!r} in this key's namespace", field="model_path"
                )
            return  # found (or not) when it is sampled: an alias resolves then
        saved = self.training().find_saved(namespace, path)  # NotFoundError saying why
        if saved.kind != "sampler_weights":
            raise InvalidRequestError(
                "a sampler needs save_weights_for_sampler's path, not save_state's",
                field="model_path",
            )

    def sample(self, namespace: str, body: dict[str, Any]) -> Future:
        published = None
        if body.get("sampling_session_id"):
            sampler = self.registry.sampler(namespace, body["sampling_session_id"])
            target = sampler.model_path or sampler.base_model
            if sampler.inflight_model is not None:  # resolved once: one version a sample
                published = self.inflight.current(namespace, sampler.inflight_model)
                target = published.path
        elif body.get("model_path"):
            self.check_sampler_path(namespace, body["model_path"])
            target = body["model_path"]
        else:
            target = self._check_base(body.get("base_model"))
        if body.get("target_prompt_logprobs") is not None:
            raise InvalidRequestError(
                "target_prompt_logprobs is not supported", field="target_prompt_logprobs"
            )
        if body.get("prompt_alt_tokens_k"):
            raise InvalidRequestError("not supported", field="prompt_alt_tokens_k")
        call = sample_call(body, self.training().limits)
        record = self.stability.before_sample(namespace, body, call, target)
        fut = self.futures.new(namespace, "Sample")
        fut.sample_sequence_ids = sequence_ids(fut.request_id, call.num_samples, published)
        topk = call.topk_prompt_logprobs

        def run() -> bytes:
            out = self.training().sample(namespace, target, call)
            if record is not None:
                record(fut.request_id, fut.sample_sequence_ids or [], out)
            return wire.sample_output_proto(out, topk, call.topk_sample_logprobs)

        job = self.completions.tracked(
            fut, target_of(namespace, body), lambda: self._finish(fut, run)
        )
        self.runner.submit(job)
        return fut
