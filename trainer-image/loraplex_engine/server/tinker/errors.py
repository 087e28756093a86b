"""How the Tinker routes report errors, in the two shapes the SDK reads.

- **A request refused at once** (a bad field, an unknown model, a wrong key) answers an
  HTTP status with the engine's error body ``{"error": {"code", "message", "field",
  ...}}`` (server/errors.py). The SDK raises the matching ``tinker.APIStatusError``
  (400 ``BadRequestError``, 401 ``AuthenticationError``, 404 ``NotFoundError``, 422
  ``UnprocessableEntityError``) with the body in its message, so the field is named.
  409 is never answered: the SDK retries a 409 for minutes, as a lock timeout.
- **A future that failed** answers ``retrieve_future`` with ``{"error": "<field>:
  <message>", "category": "user"|"server"}``; the SDK raises ``RequestFailedError``
  with that text and ``RequestErrorCategory``.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from loraplex_engine.spec.errors import (
    ApiError,
    CheckpointQuotaError,
    ConflictError,
    InvalidRequestError,
    NoCapacityError,
    ProtocolError,
    SessionGone,
    TooManyRequests,
    UnavailableError,
)

__all__ = ["ProtocolError", "SessionGone", "SessionLimit", "TooManyRequests"]
from loraplex_engine.server.errors import error_json, http_status

log = logging.getLogger("loraplex_engine.server.tinker")


class SessionLimit(TooManyRequests):
    """A namespace at its limit of open sessions: 429, with ``x-should-retry: false`` so
    the SDK reports it at once instead of retrying (a session lasts minutes)."""

    headers: ClassVar[dict[str, str]] = {"x-should-retry": "false"}


def status_of(exc: ApiError) -> int:
    if isinstance(exc, ConflictError | NoCapacityError):
        return 400  # never 409: the SDK would retry it for minutes
    return http_status(exc)


def failure_text(exc: BaseException) -> tuple[str, str]:
    """(error, category) of a future that failed with ``exc``."""
    if isinstance(exc, ApiError | ProtocolError):
        where = f"{exc.field}: " if exc.field else ""
        server = isinstance(exc, UnavailableError)
        return f"{where}{exc.message} ({exc.code})", "server" if server else "user"
    if isinstance(exc, CheckpointQuotaError):  # the caller's own quota: its to free
        return f"{exc} (checkpoint_quota)", "user"
    log.exception("tinker request failed", exc_info=exc)
    return f"internal error ({type(exc).__name__})", "server"


def as_api_error(exc: Exception) -> ApiError:
    """A capacity error on a call that cannot wait for capacity."""
    if isinstance(exc, NoCapacityError):
        return UnavailableError(exc.message, exc.field)
    if isinstance(exc, ApiError):
        return exc
    return InvalidRequestError(str(exc))


def add_protocol_error_handler(app: FastAPI) -> None:
    @app.exception_handler(ProtocolError)
    async def _protocol_error(_: Request, exc: ProtocolError) -> JSONResponse:
        headers = getattr(exc, "headers", None)
        return error_json(exc.code, exc.message, exc.field, exc.status, headers)
