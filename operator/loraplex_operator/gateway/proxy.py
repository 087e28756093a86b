"""Answers the gateway builds: its errors (the engine's error shape, which the OpenAI and
Tinker clients both read) and an engine's answer passed through, streamed when it is an
event stream.

A stream is forwarded event by event (up to each blank line), so that when the engine
is lost mid-answer (reset, or silent for ``idle_s``) the client gets the complete events
so far and then one error event, ``data: {"error": {...}}``, which the OpenAI client
raises as an ``APIError``, instead of a hang or half an event.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from starlette.responses import Response, StreamingResponse

from loraplex_operator.gateway import metrics
from loraplex_operator.gateway.routing import Engine
from loraplex_operator.gateway.upstream import checked, engine_headers, transport_reason

log = logging.getLogger("loraplex_operator.gateway.proxy")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    502: "api_error",
    503: "api_error",
}
# An engine's headers worth passing on (not hop-by-hop, not its length: bodies pass whole).
PASSED_HEADERS = ("content-type", "retry-after", "www-authenticate")


def error_body(code: str, message: str, status: int, field: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "code": code,
            "message": message,
            "field": field,
            "type": _TYPES.get(status, "api_error"),
            "param": field,
        }
    }


def error(status: int, code: str, message: str, field: str | None = None) -> Response:
    body = json.dumps(error_body(code, message, status, field)).encode()
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return Response(body, status, headers=headers, media_type="application/json")


def passed(r: httpx.Response, content: bytes | None = None) -> Response:
    headers = {k: v for k in PASSED_HEADERS if (v := r.headers.get(k)) is not None}
    return Response(r.content if content is None else content, r.status_code, headers=headers)


def lost(engine: Engine, e: httpx.TransportError) -> Response:
    log.warning("engine %s lost: %s", engine.name, e)
    return error(502, "engine_unreachable", f"the engine holding this model did not answer ({e!r})")


def sse_error(message: str) -> bytes:
    return b"data: " + json.dumps(error_body("engine_lost", message, 502)).encode() + b"\n\n"


async def stream(
    client: httpx.AsyncClient,
    engine: Engine,
    path: str,
    body: bytes,
    *,
    idle_s: float,
    namespace: str,
    on_done: Callable[[int], None],
    t0: float | None = None,
) -> Response:
    """POST ``body`` to the engine and stream its answer back as it comes. ``t0``: when
    the request arrived (``time.monotonic()``), what time to first token counts from."""
    t0 = time.monotonic() if t0 is None else t0
    request = client.build_request(
        "POST",
        engine.url + checked(path),
        content=body,
        headers={"Content-Type": "application/json", **engine_headers(engine, None)},
        timeout=httpx.Timeout(30.0, read=idle_s),
    )
    try:
        r = await client.send(request, stream=True)
    except httpx.TransportError as e:
        metrics.UPSTREAM_ERRORS.labels(transport_reason(e)).inc()
        on_done(502)
        return lost(engine, e)
    if r.status_code != 200 or not r.headers.get("content-type", "").startswith(
        "text/event-stream"
    ):
        try:
            await r.aread()
        except httpx.TransportError as e:
            metrics.UPSTREAM_ERRORS.labels(transport_reason(e)).inc()
            on_done(502)
            return lost(engine, e)
        finally:
            await r.aclose()
        on_done(r.status_code)
        return passed(r)

    async def events() -> AsyncIterator[bytes]:
        pending = b""
        first = True
        try:
            async for chunk in r.aiter_raw():
                pending += chunk
                cut = pending.rfind(b"\n\n")
                if cut < 0:
                    continue
                out, pending = pending[: cut + 2], pending[cut + 2 :]
                if first:
                    metrics.TTFT.labels(namespace).observe(time.monotonic() - t0)
                    first = False
                yield out
            if pending:
                yield pending
        except httpx.TransportError as e:
            metrics.UPSTREAM_ERRORS.labels(transport_reason(e)).inc()
            log.warning("engine %s lost mid-stream: %r", engine.name, e)
            yield sse_error(f"the engine serving this stream was lost mid-answer ({e!r})")
        finally:
            await r.aclose()
            on_done(200)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
