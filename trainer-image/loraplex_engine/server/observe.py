"""The outermost ASGI middleware: a request id, one access log line per request, and the
serving metrics of the OpenAI routes (metrics.py, ``loraplex_engine_serving_*``).

It wraps everything, auth included, so a refused request is logged and counted too. The
access line holds the method, the path (never the query string), the status, the
duration and the request id; never a header (the bearer token, tenants' API keys) or a
body. Probes and scrapes (``/healthz``, ``/readyz``, ``/metrics``) log at DEBUG: a
kubelet and a Prometheus would otherwise be most of the log.

A serving route's handler fills in the request's :class:`ServingCall` (``serving_call``):
its ``model`` once the body is read, the time of the first generated token, and the
error code of a stream that failed after its 200 had left. A code for an error answered
before that comes from the error body itself (server/errors.py), so every way a request
can fail (auth, body limit, validation, the engine) is counted by the one code its
client saw.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex_engine.metrics import EngineMetrics
from loraplex_engine.server.errors import OPENAI_PATHS

access_log = logging.getLogger("loraplex_engine.access")

QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
REQUEST_ID_HEADER = b"x-request-id"
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,64}")  # a caller's id is kept only if plain
_MAX_ERROR_BODY = 4096


@dataclass
class ServingCall:
    """What a serving handler tells the middleware about its request."""

    start: float
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    model: str | None = None
    first_token_s: float | None = None
    error_code: str | None = None

    def token(self) -> None:
        """A token was generated (the first call counts)."""
        if self.first_token_s is None:
            self.first_token_s = self.clock() - self.start

    def failed(self, error: dict[str, Any]) -> None:
        """An error event ended a stream (``choices.stream_error``'s body)."""
        self.error_code = str(error.get("error", {}).get("code") or "internal")


def serving_call(request: Request) -> ServingCall:
    """The request's ServingCall (a detached one when the app runs without Observe)."""
    call = getattr(request.state, "serving", None)
    return call if isinstance(call, ServingCall) else ServingCall(time.monotonic())


def _request_id(scope: Scope) -> str:
    for key, value in scope["headers"]:
        if key == REQUEST_ID_HEADER and _REQUEST_ID.fullmatch(value):
            return value.decode()
    return uuid.uuid4().hex


def _error_code(status: int, body: bytes) -> str:
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    if isinstance(code, str) and code:
        return code
    return "internal" if status >= 500 else "http_error"


class Observe:
    """Request id (``X-Request-ID``: the caller's if plain, else a new one, echoed in
    the response), access log, serving metrics."""

    def __init__(
        self,
        app: ASGIApp,
        metrics: EngineMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = self.clock()
        request_id = _request_id(scope)
        path = scope["path"]
        call = ServingCall(start, self.clock) if path in OPENAI_PATHS else None
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        if call is not None:
            state["serving"] = call
        status = 500  # an exception before the response started: the server's 500
        error_body = bytearray()

        async def send_observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), (REQUEST_ID_HEADER, request_id.encode())]
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and status >= 400 and not error_body:
                error_body.extend(message.get("body", b"")[:_MAX_ERROR_BODY])
            await send(message)

        try:
            await self.app(scope, receive, send_observed)
        finally:
            seconds = self.clock() - start
            if call is not None:
                code = call.error_code
                if status >= 400:
                    code = _error_code(status, bytes(error_body))
                try:
                    self.metrics.observe_serving(call.model, seconds, call.first_token_s, code)
                except Exception:  # metrics must never fail a request
                    logging.getLogger(__name__).exception("could not record serving metrics")
            level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
            if access_log.isEnabledFor(level):
                method = scope.get("method", "")
                access_log.log(
                    level,
                    "%s %s %d %.1fms request_id=%s",
                    method,
                    path,
                    status,
                    seconds * 1000,
                    request_id,
                    extra={
                        "method": method,
                        "path": path,
                        "status": status,
                        "duration_ms": round(seconds * 1000, 3),
                        "request_id": request_id,
                    },
                )
