"""The Tinker operations over :class:`TrainingService`, apart from HTTP: each checks its
request, answers at once what it can, and queues the engine call behind a future
(futures.py) on its model's lane.

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
from typing import Any

from loraplex_engine.clients.saved import engine_name, reserved
from loraplex_engine.server.tinker import wire
from loraplex_engine.server.tinker.errors import failure_text
from loraplex_engine.server.tinker.future_table import FutureTable
from loraplex_engine.server.tinker.futures import Future, Runner
from loraplex_engine.server.tinker.journal import Entry, journalled, replay
from loraplex_engine.server.tinker.sampling_params import sample_call
from loraplex_engine.server.tinker.state import Model, Registry, Sampler
from loraplex_engine.spec.errors import (
    ApiError,
    InvalidRequestError,
    NamespaceShareError,
    NoCapacityError,
    NotFoundError,
)
from loraplex_engine.spec.training_service import (
    AdamStep,
    ClientLora,
    TrainingService,
)
from loraplex_engine.versions import names

log = logging.getLogger("loraplex_engine.server.tinker")

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
JANITOR_S = 1.0


def lane(namespace: str, model_id: str) -> str:
    """A model's lane: its namespace's, so an id another namespace chose is another lane."""
    return f"{namespace}/{model_id}"


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
    ) -> None:
        self.training = training
        self.aliases = served_names  # serve --served-model-name: more names of the base
        self.unlisted = unlisted_names  # accepted, not listed: the directory's name
        self.registry = registry or Registry()
        if self.registry.adopter is None:  # client experiments' models (clients/experiments.py)
            self.registry.adopter = lambda ns, mid: self.training().adoptable(ns, mid)
            self.registry.on_adopted = lambda model, found: replay(self, model, found.steps)
        self.futures = futures if futures is not None else FutureTable()
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

    def _queue(
        self,
        model: Model,
        seq_id: int | None,
        kind: str,
        fn: Callable[[], Any] | None = None,
        pipelined: Callable[[Callable[[], None]], Any] | None = None,
        entry: tuple[str, bytes, str | None] | None = None,
    ) -> str:
        """A future for ``fn`` run on the model's lane; or for ``pipelined``, called with
        the lane's ``release`` (the engine's ``queued``): the model's next call goes to the
        engine once this one is queued there, not only once it is answered."""
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
        if pipelined is not None:
            job = pipelined
            self.runner.run_pipelined(
                lane(model.namespace, model.id),
                lambda release: finish(fut, lambda: job(release)),
                order=seq_id,
            )
        elif fn is not None:
            self.runner.run(lane(model.namespace, model.id), lambda: finish(fut, fn), order=seq_id)
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
                self.runner.park(lane(namespace, model_id), attempt)
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

        self.runner.run(lane(namespace, model_id), attempt, order=0)
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

        def load() -> dict[str, Any]:
            self.training().load_state(namespace, model.id, path, optimizer)
            return {**answer, "model_id": model.id}

        return self._queue(model, body.get("seq_id"), "LoadWeights", load)

    def forward_backward(self, namespace: str, body: bytes, encoding: str | None) -> str:
        svc = self.training()
        max_tokens = svc.limits.max_tokens
        raw = wire.decompress(body, encoding, wire.max_body_bytes(max_tokens))
        call = wire.read_forward_backward(raw, max_tokens)
        model = self.registry.model(namespace, call.model_id)
        step = svc.forward if call.forward_only else svc.forward_backward

        def run(queued: Callable[[], None]) -> bytes:
            out = step(namespace, model.id, call.data, call.loss, queued=queued)
            return wire.forward_output_proto(out)

        kind = "Forward" if call.forward_only else "ForwardBackward"
        entry = ("forward_backward", body, encoding)
        return self._queue(model, call.seq_id or None, kind, pipelined=run, entry=entry)

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

        def run(queued: Callable[[], None]) -> dict[str, Any]:
            metrics = self.training().optim_step(namespace, model.id, adam, queued=queued)
            answer = {"metrics": {k: float(v) for k, v in metrics.items()}}
            if model.journal is not None and seq is not None:  # kept, then the window moves
                model.journal.done(seq, answer)
                model.journal.stepped(seq, model.checkpoint_every)
            return answer

        entry = ("optim_step", json.dumps(body).encode(), None)
        return self._queue(model, seq, "OptimStep", pipelined=run, entry=entry)

    def save_weights(self, namespace: str, body: dict[str, Any]) -> str:
        model = self.registry.model(namespace, body["model_id"])
        seq = body.get("seq_id")
        name = _name(body.get("path"), f"state-{seq or int(time.time())}", "path")

        def run() -> dict[str, Any]:
            saved = self.training().save_state(namespace, model.id, name, "weights")
            return {"path": saved.path, "type": "save_weights"}

        entry = ("save_weights", json.dumps(body).encode(), None)
        return self._queue(model, seq, "SaveWeights", run, entry=entry)

    def save_weights_for_sampler(self, namespace: str, body: dict[str, Any]) -> str:
        model = self.registry.model(namespace, body["model_id"])
        if body.get("kind", "snapshot") != "snapshot":
            raise InvalidRequestError("only snapshot sampling clients are supported", field="kind")
        seq = body.get("seq_id")
        session_seq = body.get("sampling_session_seq_id")
        name = _name(body.get("path"), f"sampler-{seq or int(time.time())}", "path")

        def run() -> dict[str, Any]:
            svc = self.training()
            saved = svc.save_state(namespace, model.id, name, "sampler_weights")
            out = {"path": saved.path, "type": "save_weights_for_sampler"}
            if body.get("path") is None:  # save_weights_and_get_sampling_client
                session = self.registry.session(namespace, model.session_id)
                base = svc.model_name
                sampler = self.registry.add_sampler(session, base, saved.path, session_seq)
                out["sampling_session_id"] = sampler.id
            return out

        entry = ("save_weights_for_sampler", json.dumps(body).encode(), None)
        return self._queue(model, seq, "SaveWeightsForSampler", run, entry=entry)

    def unload_model(self, namespace: str, body: dict[str, Any]) -> str:
        model = self.registry.model(namespace, body["model_id"])

        def run() -> dict[str, Any]:
            self.training().unload_model(namespace, model.id)
            self.registry.drop_model(model.namespace, model.id)
            self.runner.wake()
            return {"model_id": model.id, "type": "unload_model"}

        return self._queue(model, body.get("seq_id"), "UnloadModel", run)

    def _retire(self, model: Model, *, save: bool) -> None:
        """Save (when asked) and unload a model whose client has gone."""

        def run() -> None:
            svc = self.training()
            if save:
                try:
                    name = engine_name(f"expired-{int(time.time())}")
                    svc.save_state(model.namespace, model.id, name, "weights")
                except Exception:
                    log.exception("could not save %s before unloading it", model.id)
            try:
                svc.unload_model(model.namespace, model.id)
            except NotFoundError:
                pass
            except Exception:
                log.exception("could not unload %s", model.id)
            self.registry.drop_model(model.namespace, model.id)
            self.runner.wake()
            log.info("tinker model %s of %s unloaded: its session ended", model.id, model.namespace)

        self.runner.run(lane(model.namespace, model.id), run)

    def end_session(self, namespace: str, session_id: str) -> None:
        for model in self.registry.end_session(namespace, session_id):
            self._retire(model, save=True)

    def _janitor_loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self.futures.sweep()
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
        saved = [s for s in self.training().list_saved(namespace) if s.path == path]
        if not saved:
            raise NotFoundError(f"no saved weights at {path!r}", field="model_path")
        if saved[0].kind != "sampler_weights":
            raise InvalidRequestError(
                "a sampler needs save_weights_for_sampler's path, not save_state's",
                field="model_path",
            )

    def sample(self, namespace: str, body: dict[str, Any]) -> Future:
        if body.get("sampling_session_id"):
            sampler = self.registry.sampler(namespace, body["sampling_session_id"])
            target = sampler.model_path or sampler.base_model
        elif body.get("model_path"):
            self.check_sampler_path(namespace, body["model_path"])
            target = body["model_path"]
        else:
            target = self._check_base(body.get("base_model"))
        for name in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
            if body.get(name) is not None:
                raise InvalidRequestError(f"{name} is not supported", field=name)
        for name in ("topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(name):
                raise InvalidRequestError(f"{name} is not supported", field=name)
        if body.get("record_stability_info"):
            raise InvalidRequestError("not supported", field="record_stability_info")
        call = sample_call(body, self.training().limits)
        fut = self.futures.new(namespace, "Sample")
        fut.sample_sequence_ids = [f"{fut.request_id}:{i}" for i in range(call.num_samples)]
        topk = call.topk_prompt_logprobs

        def run() -> bytes:
            out = self.training().sample(namespace, target, call)
            return wire.sample_output_proto(out, topk)

        self.runner.submit(lambda: self._finish(fut, run))
        return fut
