"""One Tinker call sent on to one engine: the pool token and namespace added by
upstream.py, the client's content type and accept headers kept, and a future in the
answer renamed to the gateway's (``<engine pod>~<id>``, routing.py) so that a later call
by that id finds the engine again. The route handlers (tinker.py, tinker_batch.py,
tinker_models.py) decide which engine; this module only carries the call there.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from loraplex_operator.gateway import proxy, routing
from loraplex_operator.gateway.routing import Engine
from loraplex_operator.gateway.upstream import Upstream

PREFIX = "/api/v1"


def json_doc(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; ``{}`` for anything else (the engine then says why)."""
    try:
        doc = json.loads(body or b"{}")
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def not_found(what: str, field: str | None = None) -> Response:
    return proxy.error(404, "not_found", f"no {what}", field)


class Forwarder:
    def __init__(self, upstream: Upstream) -> None:
        self.up = upstream

    async def to_session(
        self,
        request: Request,
        ns: str,
        route: str,
        body: bytes,
        ref: Any,
        field: str = "session_id",
    ) -> Response:
        """The call on the engine holding the session that ``ref`` (a session, model,
        sampler or run id) belongs to; 404 naming ``field`` when no engine holds it."""
        session = routing.session_of(ref if isinstance(ref, str) else None)
        engine = await self.up.find_session(ns, session) if session else None
        if engine is None:
            return not_found(f"session, model or sampler {ref!r}", field)
        return await self.forward(request, engine, ns, route, body)

    async def forward(
        self,
        request: Request,
        engine: Engine,
        ns: str,
        route: str,
        body: bytes,
        idempotent: bool = False,
        futures: Callable[[str], str] | None = None,
    ) -> Response:
        """The call on ``engine``; a future in its answer renamed by ``futures`` (default:
        ``<engine pod>~<id>``)."""
        headers = {}
        if ctype := request.headers.get("content-type"):
            headers["Content-Type"] = ctype
        if accept := request.headers.get("accept"):
            headers["Accept"] = accept
        try:
            r = await self.up.call(
                engine,
                request.method,
                f"{PREFIX}/{route}",
                ns,
                content=body or None,
                headers=headers,
                params=dict(request.query_params),
                idempotent=idempotent or request.method == "GET",
            )
        except httpx.TransportError as e:
            self.up.forget(engine)
            return proxy.lost(engine, e)
        if r.headers.get("content-type", "").startswith("application/json"):
            answer = r.json()
            rid = answer.get("request_id") if isinstance(answer, dict) else None
            if futures is not None and isinstance(rid, str):
                answer = {**answer, "request_id": futures(rid)}
            else:
                answer = routing.with_future_ids(engine.name, answer)
            return proxy.passed(r, json.dumps(answer).encode())
        return proxy.passed(r)

    async def first_answer(
        self, request: Request, engines: list[Engine], ns: str, route: str, body: bytes
    ) -> Response:
        """The first of ``engines`` (not empty) to answer below 500."""
        last: Response | None = None
        for engine in engines:
            last = await self.forward(request, engine, ns, route, body)
            if last.status_code < 500:
                return last
        assert last is not None
        return last

    async def by_future_id(self, request: Request, ns: str, route: str, body: bytes) -> Response:
        """``route`` (``retrieve_future``, ``cancel_future``) on the engine written in the
        body's ``request_id``, which leaves as the engine's own id; 404 for an id that names
        no engine of the view."""
        doc = json_doc(body)
        given = doc.get("request_id")
        split = routing.split_future_id(given) if isinstance(given, str) else None
        engine = self.up.directory.engine(split[0]) if split else None
        if split is None or engine is None:
            return not_found(f"request {given!r} (unknown, or its engine is gone)", "request_id")
        forwarded = json.dumps({**doc, "request_id": split[1]}).encode()
        return await self.forward(request, engine, ns, route, forwarded, True)
