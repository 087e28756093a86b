"""The gateway's HTTP app (starlette): the OpenAI API under /v1, the Tinker API under
/api/v1 (tinker.py), /healthz, /readyz and /metrics.

Every /v1 and /api/v1 request presents a tenant key (``Authorization: Bearer tml-...``
or ``X-API-Key``); the key's namespace bounds everything it sees. OpenAI model ids
resolve within that namespace (routing.openai_model) and go to the engine serving the
adapter, streamed through (proxy.stream) when the request asks for a stream.

Paths are not routes (paths.py): every request's path must be plain (``PlainPaths``), a
Tinker call must be one of the allowlisted routes, a model id a plain id, before
anything is forwarded.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from loraplex_operator.gateway import metrics, paths, proxy, routing, tinker_downloads
from loraplex_operator.gateway.directory import Directory
from loraplex_operator.gateway.keys import Key, presented_key
from loraplex_operator.gateway.tinker import PREFIX, Tinker
from loraplex_operator.gateway.upstream import Upstream

MAX_BODY_BYTES = 4 * 1024 * 1024  # the engine's own limit
STREAM_IDLE_S = 120.0  # a stream silent this long has lost its engine
UPSTREAM_TIMEOUT = httpx.Timeout(60.0, connect=5.0)  # retrieve_future long-polls 10 s


class TooLarge(Exception):
    pass


class PlainPaths:
    """Refuses (400) a request whose path is not plain as it came (paths.plain_path),
    before routing: what the gateway routes on is then what it could forward."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            raw = scope.get("raw_path") or scope["path"].encode("utf-8", "replace")
            found = paths.plain_path(raw.partition(b"?")[0])
            if isinstance(found, paths.Refused):
                answer = proxy.error(found.status, "invalid_path", found.message, "path")
                await answer(scope, receive, send)
                return
        await self.app(scope, receive, send)


def refused(r: paths.Refused) -> Response:
    code = "not_found" if r.status == 404 else "invalid_request"
    return proxy.error(r.status, code, r.message, r.field)


async def read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise TooLarge
    chunks, seen = [], 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            raise TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(
    directory: Directory,
    *,
    stream_idle_s: float = STREAM_IDLE_S,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_connections: int = 2000,
) -> Starlette:
    state: dict[str, Any] = {}

    def up() -> Upstream:
        return state["upstream"]

    def record(ns: str, api: str, t0: float, code: int) -> None:
        metrics.REQUESTS.labels(ns, api, str(code)).inc()
        metrics.LATENCY.labels(ns, api).observe(time.monotonic() - t0)

    def authenticate(request: Request) -> Key | None:
        return directory.keys.lookup(presented_key(request.headers))

    def unauthorized() -> Response:
        return proxy.error(401, "unauthorized", "missing or unknown API key (tml-...)")

    async def healthz(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(_: Request) -> Response:
        if not directory.loaded:
            return JSONResponse({"status": "loading"}, 503)
        return JSONResponse({"status": "ready", "engines": len(directory.engines)})

    async def metrics_route(_: Request) -> Response:
        metrics.ENGINES.set(len(directory.engines))
        metrics.KEYS.set(len(directory.keys))
        return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)

    async def list_models(request: Request) -> Response:
        t0, key = time.monotonic(), authenticate(request)
        if key is None:
            record("", "openai", t0, 401)
            return unauthorized()
        cards = routing.namespace_models(key.namespace, await up().model_cards())
        record(key.namespace, "openai", t0, 200)
        return JSONResponse({"object": "list", "data": cards})

    async def get_model(request: Request) -> Response:
        t0, key = time.monotonic(), authenticate(request)
        if key is None:
            record("", "openai", t0, 401)
            return unauthorized()
        given = request.path_params["id"]
        if bad := paths.model_problem(given):
            record(key.namespace, "openai", t0, bad.status)
            return refused(bad)
        mid = routing.openai_model(key.namespace, given)
        engine = await up().find_adapter(mid)
        if engine is None:
            record(key.namespace, "openai", t0, 404)
            return proxy.error(404, "not_found", f"no model {given!r}", "model")
        try:
            r = await up().call(engine, "GET", paths.model_path(mid), None, idempotent=True)
        except httpx.TransportError as e:
            record(key.namespace, "openai", t0, 502)
            return proxy.lost(engine, e)
        record(key.namespace, "openai", t0, r.status_code)
        return proxy.passed(r)

    async def completions(request: Request) -> Response:
        return await complete(request, "/v1/completions")

    async def chat_completions(request: Request) -> Response:
        return await complete(request, "/v1/chat/completions")

    async def complete(request: Request, path: str) -> Response:
        """``path``: the route matched, forwarded as written here (never the path given)."""
        t0, key = time.monotonic(), authenticate(request)
        if key is None:
            record("", "openai", t0, 401)
            return unauthorized()
        ns = key.namespace
        try:
            doc = json.loads(await read_body(request, max_body_bytes))
        except TooLarge:
            record(ns, "openai", t0, 413)
            return proxy.error(413, "too_large", f"request body over {max_body_bytes} bytes")
        except (ValueError, ClientDisconnect):
            record(ns, "openai", t0, 400)
            return proxy.error(400, "invalid_request", "the body is not JSON")
        if not isinstance(doc, dict):
            record(ns, "openai", t0, 422)
            return proxy.error(422, "invalid_request", "the body is not a JSON object")
        if bad := paths.model_problem(doc.get("model")):
            record(ns, "openai", t0, bad.status)
            return refused(bad)
        given = doc["model"]
        doc["model"] = routing.openai_model(ns, given)
        engine = await up().find_adapter(doc["model"])
        if engine is None:
            record(ns, "openai", t0, 404)
            return proxy.error(404, "not_found", f"no model {given!r}", "model")
        body = json.dumps(doc).encode()
        if doc.get("stream"):
            return await proxy.stream(
                up().client,
                engine,
                path,
                body,
                idle_s=stream_idle_s,
                namespace=ns,
                on_done=lambda code: record(ns, "openai", t0, code),
                t0=t0,
            )
        try:
            r = await up().call(
                engine,
                "POST",
                path,
                None,
                content=body,
                headers={"Content-Type": "application/json"},
                timeout=None,
            )
        except httpx.TransportError as e:
            up().forget(engine)
            record(ns, "openai", t0, 502)
            return proxy.lost(engine, e)
        record(ns, "openai", t0, r.status_code)
        return proxy.passed(r)

    async def tinker(request: Request) -> Response:
        t0, key = time.monotonic(), authenticate(request)
        route = request.path_params["route"]
        if route == "healthz":
            return JSONResponse({"status": "ok"})
        call = paths.match_tinker(request.method, route)
        if isinstance(call, paths.TinkerCall) and tinker_downloads.is_download(call):
            # A signed download URL: the signature is the credential (tinker_downloads.py).
            answer = await tinker_downloads.download(state["upstream"], request, key, call)
            # (the URL's namespace is the caller's word: never a metric label)
            record(key.namespace if key else "", "tinker", t0, answer.status_code)
            return answer
        if key is None:
            record("", "tinker", t0, 401)
            return unauthorized()
        if isinstance(call, paths.Refused):
            record(key.namespace, "tinker", t0, call.status)
            return refused(call)
        try:
            body = await read_body(request, max_body_bytes)
        except TooLarge:
            record(key.namespace, "tinker", t0, 413)
            return proxy.error(413, "too_large", f"request body over {max_body_bytes} bytes")
        answer = await state["tinker"].handle(request, key, call, body)
        record(key.namespace, "tinker", t0, answer.status_code)
        return answer

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=200)
        async with httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT, limits=limits) as client:
            state["upstream"] = Upstream(directory, client)
            state["tinker"] = Tinker(state["upstream"])
            await directory.start()
            try:
                yield
            finally:
                await directory.close()

    routes = [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics_route),
        Route("/v1/models", list_models),
        Route("/v1/models/{id:path}", get_model),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        # every method of an allowlisted route (paths.py): checkpoint TTLs are PUT, deletes DELETE
        Route(PREFIX + "/{route:path}", tinker, methods=["GET", "POST", "PUT", "DELETE"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(PlainPaths)])
