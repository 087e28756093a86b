"""The Tinker API (``/api/v1/...``) for every pool: each call authenticated by the
tenant's key, checked against its role, and sent to the engine that holds what it names
(routing.py) with the pool token and ``X-Loraplex-Namespace``. Only the allowlisted
routes reach here (paths.py), each as the route rebuilt from its checked parts.

Stage 1 (docs/design/gateway.md): a session lives on one engine, chosen at
``create_session`` among the pools that admit the namespace (most room: registered, not
resident, where the engine pages: routing.registered_room); its
models and samplers live there too. The gateway finds a session's engine by asking the
engines, and a future's engine is written in the future's id, so any replica answers
any call and a replica lost mid-training loses nothing.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loraplex_operator.gateway import proxy, routing, tinker_batch, tinker_downloads
from loraplex_operator.gateway.forwarding import PREFIX, Forwarder, json_doc
from loraplex_operator.gateway.keys import Key
from loraplex_operator.gateway.paths import TinkerCall
from loraplex_operator.gateway.tinker_models import Models
from loraplex_operator.gateway.upstream import Upstream

PROTOBUF = "application/x-protobuf"

# The engine's client config (loraplex_engine/server/tinker/routes.py CLIENT_CONFIG) but for
# compression: the gateway reads forward_backward's model id from the protobuf, so the
# SDK sends it uncompressed (tests/operator/gateway/test_gateway_pure.py keeps the two in step).
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": True,
    "fwdbwd_max_chunk_len": 256,
    "fwdbwd_max_chunk_bytes_count": 2_000_000,
    "use_pyqwest_transport": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}
LOCAL = {
    "client/config": CLIENT_CONFIG,
    "client/dynamic_config": {"refresh_interval_sec": 300, "sample_cancel_enabled": False},
    "telemetry": {"status": "accepted"},
}
BY_SESSION = frozenset({"session_heartbeat", "create_model", "create_sampling_session"})
BY_MODEL = frozenset(
    {
        "get_info",
        "optim_step",
        "save_weights",
        "save_weights_for_sampler",
        "save_weights_external",
        "unload_model",
    }
)
BY_FUTURE_ID = frozenset({"retrieve_future", "cancel_future"})  # forwarding.by_future_id
ANY_ENGINE = frozenset({"get_server_capabilities", "create_custom_loss"})
LISTINGS = {"training_runs": "training_runs", "checkpoints": "checkpoints"}
LIST_ALL = {"limit": "1000", "offset": "0"}


class Tinker:
    def __init__(self, upstream: Upstream) -> None:
        self.up = upstream
        self.forwarder = Forwarder(upstream)
        # Item 3 (gateway/tinker_models.py) where the view has the Kubernetes API.
        self.models = Models(self.forwarder) if upstream.directory.models_as_experiments else None

    async def handle(self, request: Request, key: Key, call: TinkerCall, body: bytes) -> Response:
        route = call.route
        name = route.split("/", 1)[0]
        if route in LOCAL:
            return JSONResponse(LOCAL[route])
        if not key.may(call.name):  # the route matched and forwarded, not the path given
            return proxy.error(
                403,
                "forbidden",
                f"this API key ({key.role}) may not call {call.name}: it needs the train role",
            )
        ns = key.namespace
        if self.models is not None:
            answer = await self.models.handle(request, ns, route, body)
            if answer is not None:
                return answer
        if route == "create_session":
            return await self._create_session(request, ns, body)
        if route in ANY_ENGINE:
            return await self._any_engine(request, ns, route, body)
        if name in LISTINGS and "/" not in route:
            return await self._listing(request, ns, name)
        if name in ("forward_backward", "forward"):
            if request.headers.get("content-encoding"):
                return proxy.error(
                    422, "invalid_request", "send forward_backward uncompressed to the gateway"
                )
            model_id = routing.proto_string_field(body, 1)
            return await self.forwarder.to_session(request, ns, route, body, model_id, "model_id")
        if route in BY_FUTURE_ID:
            return await self.forwarder.by_future_id(request, ns, route, body)
        if route == "retrieve_futures":
            return await tinker_batch.retrieve_futures(self.forwarder, request, ns, body)
        doc = json_doc(body)
        if route in BY_SESSION:
            return await self.forwarder.to_session(request, ns, route, body, doc.get("session_id"))
        if route in BY_MODEL:
            return await self.forwarder.to_session(
                request, ns, route, body, doc.get("model_id"), "model_id"
            )
        if route == "load_weights":
            ref = doc.get("session_id") or doc.get("model_id") or doc.get("path")
            return await self.forwarder.to_session(request, ns, route, body, ref, "path")
        if route == "asample":
            ref = doc.get("sampling_session_id") or doc.get("model_path")
            if ref:
                return await self.forwarder.to_session(request, ns, route, body, ref, "model_path")
            return await self._any_engine(request, ns, route, body)
        if name == "training_runs" and route.endswith(tinker_downloads.URLS_SUFFIX):
            return await tinker_downloads.signed_urls(self.forwarder, request, ns, route)
        if name in ("sessions", "samplers", "training_runs"):
            ref = route.split("/")[1] if "/" in route else None
            return await self.forwarder.to_session(request, ns, route, body, ref)
        return proxy.error(404, "not_found", f"no Tinker route {route!r}")

    async def _create_session(self, request: Request, ns: str, body: bytes) -> Response:
        engines = self.up.directory.admitting(ns)
        free = await self.up.room(engines)
        choice = routing.pick_engine(free) or next(iter(sorted(free)), None)
        engine = self.up.directory.engine(choice) if choice else None
        if engine is None:
            return proxy.error(
                503, "unavailable", f"no engine of a pool that admits namespace {ns!r} answers"
            )
        answer = await self.forwarder.forward(request, engine, ns, "create_session", body)
        if answer.status_code == 200:
            session = json.loads(bytes(answer.body)).get("session_id")
            if isinstance(session, str):
                self.up.remember_session(ns, session, engine)
        return answer

    async def _any_engine(self, request: Request, ns: str, route: str, body: bytes) -> Response:
        engines = self.up.directory.admitting(ns)
        if not engines:
            return proxy.error(503, "unavailable", f"no pool admits namespace {ns!r}")
        return await self.forwarder.first_answer(request, engines, ns, route, body)

    async def _listing(self, request: Request, ns: str, name: str) -> Response:
        """A REST listing gathered from every admitting engine, then paged here."""
        engines = self.up.directory.admitting(ns)
        answers = await self.up.gather(engines, f"{PREFIX}/{name}", ns, LIST_ALL)
        items: dict[str, Any] = {}
        for answer in answers:
            for item in answer.get(LISTINGS[name]) or []:
                ident = item.get("training_run_id") or item.get("tinker_path")
                items.setdefault(str(ident), item)
        try:
            limit = max(1, min(int(request.query_params.get("limit", 20)), 1000))
            offset = max(0, int(request.query_params.get("offset", 0)))
        except ValueError:
            return proxy.error(422, "invalid_request", "limit and offset are integers")
        ordered = [items[k] for k in sorted(items)]
        cursor = {"offset": offset, "limit": limit, "total_count": len(ordered)}
        return JSONResponse({LISTINGS[name]: ordered[offset : offset + limit], "cursor": cursor})
