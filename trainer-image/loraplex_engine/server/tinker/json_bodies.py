"""JSON request bodies parsed off the event loop when they are big.

FastAPI parses a JSON body with ``json.loads`` on the event loop before the route runs;
a body near the server's 4 MiB limit takes tens of milliseconds there, during which
every tenant's polls and ``/healthz`` wait. A route built by :func:`off_loop_json_route`
parses a body over ``INLINE_BYTES`` on one of the decode threads (the same bounded
limiter as the ``forward_backward`` decodes) and leaves the parsed value where FastAPI
looks for it (Starlette's ``Request.json`` caches it as ``_json``). Small bodies, the
SDK's polls and heartbeats, stay on the loop: a thread hop costs more than they do, and
waits for the GIL while a tick runs.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from fastapi import Request, Response
from fastapi.routing import APIRoute

# A body up to this size parses in well under a millisecond: on the loop.
INLINE_BYTES = 64 * 1024


def parse_json(body: bytes) -> Any:
    return json.loads(body)


def off_loop_json_route(limiter: anyio.CapacityLimiter) -> type[APIRoute]:
    """An ``APIRoute`` class whose JSON bodies over ``INLINE_BYTES`` are parsed on one
    of ``limiter``'s threads."""

    class OffLoopJsonRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
            handle = super().get_route_handler()

            async def parse_then_handle(request: Request) -> Response:
                if _is_json(request):
                    body = await request.body()
                    if len(body) > INLINE_BYTES:
                        try:
                            parsed = await anyio.to_thread.run_sync(
                                parse_json, body, limiter=limiter
                            )
                        except ValueError:
                            parsed = None  # left to FastAPI, which answers its own 422
                        else:
                            request._json = parsed  # Starlette's cache, read by FastAPI
                return await handle(request)

            return parse_then_handle

    return OffLoopJsonRoute


def _is_json(request: Request) -> bool:
    kind = request.headers.get("content-type", "application/json")
    return kind.split(";")[0].strip().lower().endswith("json")
