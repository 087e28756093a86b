"""The gateway's HTTP app (starlette): the OpenAI API under /v1, the Tinker API under
/api/v1 (tinker.py), /healthz, /readyz and /metrics.

Every /v1 and /api/v1 request presents a tenant key (``Authorization: Bearer tml-...``
or ``X-API-Key``); the key's namespace bounds everything it sees. OpenAI model ids
resolve within that namespace (routing.openai_model) and go to the engine serving the
adapter, streamed through (proxy.stream) when the request asks for a stream.
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
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex_operator.gateway import metrics, proxy, routing
from loraplex_operator.gateway.directory import Directory
from loraplex_operator.gateway.keys import Key, presented_key
from loraplex_operator.gateway.tinker import PREFIX, Tinker
from loraplex_operator.gateway.upstream import Upstream

MAX_BODY_BYTES = 4 * 1024 * 1024  # the engine's own limit
STREAM_IDLE_S = 120.0  # a stream silent this long has lost its engine
UPSTREAM_TIMEOUT = httpx.Timeout(60.0, connect=5.0)  # retrieve_future long-polls 10 s


class TooLarge(Exception):
    pass


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
        engine = await up().find_adapter(routing.openai_model(key.namespace, given))
        if engine is None:
            record(key.namespace, "openai", t0, 404)
            return proxy.error(404, "not_found", f"no model {given!r}", "model")
        mid = routing.openai_model(key.namespace, given)
        try:
            r = await up().call(engine, "GET", f"/v1/models/{mid}", None, idempotent=True)
        except httpx.TransportError as e:
            record(key.namespace, "openai", t0, 502)
            return proxy.lost(engine, e)
        record(key.namespace, "openai", t0, r.status_code)
        return proxy.passed(r)

    async def complete(request: Request) -> Response:
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
        if not isinstance(doc, dict) or not isinstance(doc.get("model"), str):
            record(ns, "openai", t0, 422)
            return proxy.error(422, "invalid_request", "model is required", "model")
        given = doc["model"]
        doc["model"] = routing.openai_model(ns, given)
        engine = await up().find_adapter(doc["model"])
        if engine is None:
            record(ns, "openai", t0, 404)
            return proxy.error(404, "not_found", f"no model {given!r}", "model")
        body, path = json.dumps(doc).encode(), request.url.path
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
        if key is None:
            record("", "tinker", t0, 401)
            return unauthorized()
        try:
            body = await read_body(request, max_body_bytes)
        except TooLarge:
            record(key.namespace, "tinker", t0, 413)
            return proxy.error(413, "too_large", f"request body over {max_body_bytes} bytes")
        answer = await state["tinker"].handle(request, key, route, body)
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
        Route("/v1/completions", complete, methods=["POST"]),
        Route("/v1/chat/completions", complete, methods=["POST"]),
        Route(PREFIX + "/{route:path}", tinker, methods=["GET", "POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)
