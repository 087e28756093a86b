"""Tinker models as experiments (issue 29 item 3): the gateway's I/O around
gateway/experiments.py's decisions (docs/design/gateway.md).

With the Kubernetes view, sessions are the gateway's (``s`` + 20 hex, nothing held),
``create_model`` creates a ``LoRAExperiment`` with ``spec.client`` in the key's
namespace, and a model's calls go to the engine its experiment is Running on, read from
its status; while it has none (pending, preempted, suspended, moving after its pod died)
they are answered with the SDK's paused queue state. ``handle`` answers None for what
stays stage 1's (sampling sessions, listings, capabilities).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loraplex_operator import client_modules, idle
from loraplex_operator.gateway import experiments as gx
from loraplex_operator.gateway import proxy, routing
from loraplex_operator.gateway.forwarding import Forwarder, json_doc
from loraplex_operator.gateway.routing import Engine
from loraplex_operator.kube import KubeError

log = logging.getLogger("loraplex_operator.gateway.tinker_models")

# Routes whose JSON body names the model by ``model_id`` (forward_backward's is in its
# protobuf, field 1).
PAUSED_POLL_S = 5.0  # a paused model's retrieve_future waits this long before try_again
PAUSED_RECHECK_S = 0.5
BY_MODEL = frozenset(
    {"get_info", "optim_step", "save_weights", "save_weights_for_sampler", "load_weights"}
)


def new_session_id() -> str:
    return "s" + secrets.token_hex(10)


class Models:
    def __init__(self, forwarder: Forwarder) -> None:
        self.forwarder = forwarder
        self.up = forwarder.up
        self.directory = forwarder.up.directory

    async def handle(self, request: Request, ns: str, route: str, body: bytes) -> Response | None:
        name = route.split("/", 1)[0]
        if route == "create_session":
            return JSONResponse({"type": "create_session", "session_id": new_session_id()})
        if route == "session_heartbeat":
            sid = json_doc(body).get("session_id")
            if isinstance(sid, str) and gx.SESSION.fullmatch(sid):
                return JSONResponse({"type": "session_heartbeat"})
            return proxy.error(404, "not_found", f"no session {sid!r}", "session_id")
        if name == "sessions" and route.endswith("/finish"):
            return JSONResponse({})  # its models are experiments: they outlive the session
        if route == "create_model":
            return await self._create(ns, json_doc(body))
        if route == "retrieve_future":
            return await self._retrieve(request, ns, body)
        if route == "create_sampling_session":
            return self._base_sampler(ns, json_doc(body))
        if route == "asample":
            return await self._sample_base(request, ns, json_doc(body))
        if name == "samplers" and (split := gx.split_base_sampler(route[len(name) + 1 :])):
            sid = route[len(name) + 1 :]
            return JSONResponse({"sampler_id": sid, "base_model": split[1], "model_path": None})
        if name in ("forward_backward", "forward"):
            if request.headers.get("content-encoding"):
                return None  # tinker.py answers 422
            model_id = routing.proto_string_field(body, 1)
        elif route in BY_MODEL or route == "unload_model":
            model_id = json_doc(body).get("model_id")
        else:
            return None
        exp = gx.experiment_name(model_id if isinstance(model_id, str) else None)
        if exp is None:
            return None  # not a gateway model (stage 1's, or a load_weights by path)
        if route == "unload_model":
            return await self._unload(request, ns, exp, body)
        return await self._to_model(request, ns, route, body, exp)

    def _serving(self, ns: str, given: object) -> list[Engine] | Response:
        """The admitting engines that serve the base model ``given`` names, or the answer
        saying why there is none (422: not a name; 503: no pool admits; 404: not served)."""
        try:
            base = gx.base_model_name(given)
        except gx.BadRequest as e:
            return proxy.error(422, "invalid_request", e.message, e.field)
        engines = self.directory.admitting(ns)
        if not engines:
            return proxy.error(503, "unavailable", f"no pool admits namespace {ns!r}")
        serving = [e for e in engines if e.serves(base)]
        if not serving and base is not None:
            why = gx.not_served(ns, base, {e.base_model for e in engines})
            return proxy.error(404, "not_found", why, "base_model")
        return serving

    def _base_sampler(self, ns: str, doc: dict[str, Any]) -> Response | None:
        """A gateway session's sampler of the base model alone, answered here (no engine
        holds the session); one with a model path is its model's engine's (None)."""
        session = doc.get("session_id")
        if doc.get("model_path") is not None or not gx.SESSION.fullmatch(str(session)):
            return None
        serving = self._serving(ns, doc.get("base_model"))
        if isinstance(serving, Response):
            return serving
        base = gx.base_model_name(doc.get("base_model")) or serving[0].base_model
        sid = base and gx.base_sampler_id(str(session), doc.get("sampling_session_seq_id"), base)
        if not sid:
            why = gx.not_served(ns, str(base), set())
            return proxy.error(404, "not_found", why, "base_model")
        return JSONResponse({"type": "create_sampling_session", "sampling_session_id": sid})

    async def _sample_base(self, request: Request, ns: str, doc: dict[str, Any]) -> Response | None:
        """A base-model sampler's samples: on an admitting engine serving its model, as a
        sample of the base by name (the engine holds no sampler for it)."""
        split = gx.split_base_sampler(doc.get("sampling_session_id"))
        if split is None:
            return None
        serving = self._serving(ns, split[1])
        if isinstance(serving, Response):
            return serving
        body = json.dumps({**doc, "sampling_session_id": None, "base_model": split[1]}).encode()
        return await self.forwarder.first_answer(request, serving, ns, "asample", body)

    async def _create(self, ns: str, doc: dict[str, Any]) -> Response:
        engines = self._serving(ns, doc.get("base_model"))
        if isinstance(engines, Response):
            return engines
        try:  # the pool is filled in below; the body is checked first
            client = gx.manifest(ns, "", doc)["spec"]["client"]
        except gx.BadRequest as e:
            return proxy.error(422, "invalid_request", e.message, e.field)
        free = await self.up.room(engines)
        refusals = {e.name: self._refused(e, client) for e in engines}
        free = {name: n for name, n in free.items() if refusals.get(name) is None}
        choice = routing.pick_engine(free) or next(iter(sorted(free)), None)
        engine = self.directory.engine(choice) if choice else None
        if engine is None:
            refused = next((r for r in refusals.values() if r is not None), None)
            return refused or proxy.error(
                503, "unavailable", f"no engine of a pool that admits namespace {ns!r} answers"
            )
        obj = gx.manifest(ns, engine.pool, doc)
        if engine.allowed_target_modules is not None:
            allowed = engine.allowed_target_modules
            obj["spec"]["client"] = client_modules.granted(obj["spec"]["client"], allowed)
        await self.directory.create_experiment(obj)  # exists already: a resent create
        name = obj["metadata"]["name"]
        return JSONResponse({"request_id": gx.create_future(name), "model_id": None})

    def _refused(self, engine: Engine, client: dict[str, Any]) -> Response | None:
        """422 where the module kinds asked would train a module the engine's pool does not
        allow (as the operator's admission: client_modules.py); None where it may take it."""
        allowed, wrapped = engine.allowed_target_modules, self.up.wrapped.get(engine.name)
        if allowed is None or wrapped is None:
            return None  # not known here: the operator's admission checks it
        asked = client_modules.granted(client, allowed)
        for _, wire, extra in client_modules.refused(asked, wrapped, allowed):
            why = client_modules.message(engine.pool, extra, allowed, f"lora_config.{wire}")
            return proxy.error(422, "invalid_request", why, f"lora_config.{wire}")
        return None

    async def _binding(self, ns: str, exp: str) -> gx.Binding | None:
        obj = await self.directory.get_experiment(ns, exp)
        if obj is None:
            return None
        found = gx.binding(obj)
        if found.wake:  # its idle TTL suspended it: this call resumes it (paused meanwhile)
            try:
                await self.directory.patch_experiment(ns, exp, idle.resume_patch())
            except KubeError as e:
                log.warning("resuming idle %s/%s: %s", ns, exp, e)
        if found.state == "running" and self.directory.engine(found.engine or "") is None:
            return gx.Binding("paused", None, f"the model's engine {found.engine} is not ready")
        return found

    async def _to_model(
        self, request: Request, ns: str, route: str, body: bytes, exp: str
    ) -> Response:
        found = await self._binding(ns, exp)
        if found is None:
            return proxy.error(404, "not_found", f"no model (experiment {exp!r})", "model_id")
        if found.state == "failed":
            return proxy.error(409, "failed", found.reason, "model_id")
        engine = self.directory.engine(found.engine or "")
        if found.state != "running" or engine is None:
            return JSONResponse(gx.paused_error(found.reason), 503)
        return await self.forwarder.forward(
            request, engine, ns, route, body, futures=lambda rid: gx.model_future(exp, rid)
        )

    async def _unload(self, request: Request, ns: str, exp: str, body: bytes) -> Response:
        """The experiment is deleted (its saved states stay); a Running one's engine
        unloads the model first and answers the future."""
        found = await self._binding(ns, exp)
        if found is None:
            return proxy.error(404, "not_found", f"no model (experiment {exp!r})", "model_id")
        answer: Response = JSONResponse(
            {"request_id": gx.unloaded_future(exp), "model_id": gx.model_id_of(exp)}
        )
        engine = self.directory.engine(found.engine or "")
        if found.state == "running" and engine is not None:
            answer = await self.forwarder.forward(
                request,
                engine,
                ns,
                "unload_model",
                body,
                futures=lambda rid: gx.model_future(exp, rid),
            )
        await self.directory.delete_experiment(ns, exp)
        return answer

    async def _retrieve(self, request: Request, ns: str, body: bytes) -> Response | None:
        doc = json_doc(body)
        given = doc.get("request_id")
        split = gx.split_future(given) if isinstance(given, str) else None
        if split is None:
            return None  # a stage 1 future
        kind, exp, rid = split
        if kind == "unloaded":
            return JSONResponse({"model_id": gx.model_id_of(exp), "type": "unload_model"})
        found = await self._binding(ns, exp)
        # The SDK polls a try_again again at once: hold it a while, as an engine's long
        # poll does, looking again, so that a paused model is not a busy loop.
        deadline = time.monotonic() + PAUSED_POLL_S
        while found is not None and found.state == "paused" and time.monotonic() < deadline:
            await asyncio.sleep(PAUSED_RECHECK_S)
            found = await self._binding(ns, exp)
        if found is None:
            return proxy.error(404, "not_found", f"no model (experiment {exp!r})", "request_id")
        if found.state == "failed":
            return JSONResponse({"error": found.reason, "category": "user"})
        engine = self.directory.engine(found.engine or "")
        if found.state != "running" or engine is None:
            # 408, as an engine answers a pending future: the SDK polls again quietly.
            return JSONResponse(gx.paused_future(str(given), found.reason), 408)
        if kind == "create":
            return JSONResponse(gx.created_answer(exp))
        forwarded = json.dumps({**doc, "request_id": rid}).encode()
        return await self.forwarder.forward(
            request,
            engine,
            ns,
            "retrieve_future",
            forwarded,
            True,
            futures=lambda r: gx.model_future(exp, r),
        )
