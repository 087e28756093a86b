"""Calls from the gateway to engines, and finding which engine holds what by asking them.

Each call carries the engine pool's token; Tinker calls add ``X-Loraplex-Namespace`` (the
key's namespace: the engine answers for that namespace alone). What the engines said is
cached briefly (which engine holds a session, an adapter): soft state, re-learned by
asking again on a miss, a transport error, or a restart.

Retries: a call that never reached the engine (connect error) is retried on any
method, once the directory has had a chance to change; a call that may have reached it
is retried only when it is idempotent (GETs, ``retrieve_future``).

A path sent here must be plain (paths.plain_path): one with a dot segment would be
normalised by httpx into another route, so it is refused as a bug, never sent.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from typing import Any

import httpx

from loraplex_operator.gateway import metrics, paths, routing
from loraplex_operator.gateway.directory import Directory
from loraplex_operator.gateway.routing import Engine

NAMESPACE_HEADER = "X-Loraplex-Namespace"
CACHE_S = 30.0
CONNECT_RETRIES = 2
RETRY_PAUSE_S = 0.2
ASK_TIMEOUT_S = 5.0


def engine_headers(engine: Engine, namespace: str | None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {engine.token}"}
    if namespace is not None:
        headers[NAMESPACE_HEADER] = namespace
    return headers


def checked(path: str) -> str:
    """``path`` if plain; a ValueError (a bug: callers build paths from checked parts)."""
    if isinstance(found := paths.plain_path(path.encode("utf-8")), paths.Refused):
        raise ValueError(f"not sent to an engine: {found.message}")
    return path


def transport_reason(e: httpx.TransportError) -> str:
    if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
        return "connect"
    if isinstance(e, httpx.TimeoutException):
        return "timeout"
    return "reset"


class _Cache:
    def __init__(self, ttl_s: float = CACHE_S, size: int = 50_000) -> None:
        self.ttl_s, self.size = ttl_s, size
        self._d: dict[str, tuple[str, float]] = {}

    def get(self, key: str) -> str | None:
        hit = self._d.get(key)
        if hit is None or hit[1] < time.monotonic():
            return None
        return hit[0]

    def put(self, key: str, value: str) -> None:
        if len(self._d) >= self.size:
            self._d.clear()  # soft state: asking again is always right
        self._d[key] = (value, time.monotonic() + self.ttl_s)

    def drop(self, key: str) -> None:
        self._d.pop(key, None)


class Upstream:
    def __init__(self, directory: Directory, client: httpx.AsyncClient) -> None:
        self.directory = directory
        self.client = client
        self.sessions = _Cache()  # "<namespace>/<session>" -> engine name
        self.adapters = _Cache()  # engine model id -> engine name
        self.wrapped: dict[str, list[str]] = {}  # engine name -> its targetModules, as said

    async def call(
        self,
        engine: Engine,
        method: str,
        path: str,
        namespace: str | None,
        *,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, Any] | None = None,
        idempotent: bool = False,
        timeout: float | None = None,
    ) -> httpx.Response:
        """One buffered call; transport errors raise after the retries allowed."""
        checked(path)
        attempt = 0
        while True:
            try:
                return await self.client.request(
                    method,
                    engine.url + path,
                    content=content,
                    headers={**(headers or {}), **engine_headers(engine, namespace)},
                    params=params,
                    timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
                )
            except httpx.TransportError as e:
                metrics.UPSTREAM_ERRORS.labels(transport_reason(e)).inc()
                never_sent = isinstance(e, httpx.ConnectError | httpx.ConnectTimeout)
                attempt += 1
                if attempt > CONNECT_RETRIES or not (never_sent or idempotent):
                    raise
                await asyncio.sleep(RETRY_PAUSE_S * attempt)

    async def _ask(
        self, engines: list[Engine], method: str, path: str, namespace: str | None, **kw: Any
    ) -> list[tuple[Engine, httpx.Response | None]]:
        async def one(e: Engine) -> tuple[Engine, httpx.Response | None]:
            try:
                r = await self.call(e, method, path, namespace, timeout=ASK_TIMEOUT_S, **kw)
                return e, r
            except httpx.TransportError:
                return e, None

        return list(await asyncio.gather(*(one(e) for e in engines)))

    async def find_session(self, namespace: str, session: str) -> Engine | None:
        """The engine holding ``namespace``'s ``session`` (a heartbeat answers 200 only
        there: another namespace's session answers 404 like one that does not exist)."""
        key = f"{namespace}/{session}"
        cached = self.sessions.get(key)
        if cached and (engine := self.directory.engine(cached)) is not None:
            return engine
        body = json.dumps({"session_id": session}).encode()
        answers = await self._ask(
            self.directory.engines,
            "POST",
            "/api/v1/session_heartbeat",
            namespace,
            content=body,
            headers={"Content-Type": "application/json"},
        )
        for engine, r in answers:
            if r is not None and r.status_code in (200, 410):  # 410: there, and ended
                self.sessions.put(key, engine.name)
                return engine
        return None

    def remember_session(self, namespace: str, session: str, engine: Engine) -> None:
        self.sessions.put(f"{namespace}/{session}", engine.name)

    def forget(self, engine: Engine) -> None:
        """After a transport error: this engine's answers are not to be trusted."""
        for cache in (self.sessions, self.adapters):
            for k in [k for k, (v, _) in cache._d.items() if v == engine.name]:
                cache.drop(k)

    async def find_adapter(self, model_id: str) -> Engine | None:
        """The engine serving the adapter ``model_id`` (``<namespace>.<name>``)."""
        cached = self.adapters.get(model_id)
        if cached and (engine := self.directory.engine(cached)) is not None:
            return engine
        answers = await self._ask(
            self.directory.engines, "GET", paths.model_path(model_id), None, idempotent=True
        )
        for engine, r in answers:
            if r is not None and r.status_code == 200:
                self.adapters.put(model_id, engine.name)
                return engine
        return None

    async def room(self, engines: list[Engine]) -> dict[str, int]:
        """Each answering engine's room for one more model (routing.registered_room)."""
        answers = await self._ask(engines, "GET", "/v1/capacity", None, idempotent=True)
        out = {}
        for engine, r in answers:
            if r is not None and r.status_code == 200:
                body = r.json()
                out[engine.name] = routing.registered_room(body)
                if isinstance(modules := body.get("targetModules"), list):
                    self.wrapped[engine.name] = [str(m) for m in modules]
        return out

    async def model_cards(self) -> list[dict[str, Any]]:
        answers = await self._ask(
            self.directory.engines, "GET", "/v1/models", None, idempotent=True
        )
        cards: list[dict[str, Any]] = []
        for _, r in answers:
            if r is not None and r.status_code == 200:
                cards += r.json().get("data") or []
        return cards

    async def gather(
        self, engines: list[Engine], path: str, namespace: str, params: Mapping[str, Any]
    ) -> list[dict[str, Any]]:
        """Every engine's JSON answer to a GET (the REST listings), those that answered."""
        answers = await self._ask(engines, "GET", path, namespace, params=params, idempotent=True)
        return [r.json() for _, r in answers if r is not None and r.status_code == 200]
