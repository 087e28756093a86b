"""How the HTTP API reports errors: ``{"error": {"code", "message", "field", "type",
"param"}}``: the engine's own keys and OpenAI's (``type``, ``param`` = ``field``), so
both the operator's client and OpenAI clients read them.

The one place an HTTP status is chosen for an :class:`ApiError` (spec/errors.py knows nothing
of HTTP), the translation of pydantic's request validation errors into a field path,
and the app's exception handlers. Only a bug in the engine answers 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex_engine.spec.echo import clip
from loraplex_engine.spec.errors import (
    ApiError,
    BadCheckpointError,
    BodyTooLargeError,
    ConflictError,
    InvalidRequestError,
    InvalidSpecError,
    NamespaceShareError,
    NoCapacityError,
    NotFoundError,
    UnauthorizedError,
    UnavailableError,
)

log = logging.getLogger("loraplex_engine.server.app")

# A class not listed answers its nearest listed base's status;
# tests/engine/spec/test_errors.py requires every ApiError subclass to be listed.
HTTP_STATUS: dict[type[ApiError], int] = {
    ApiError: 400,
    UnauthorizedError: 401,
    NotFoundError: 404,
    ConflictError: 409,
    NoCapacityError: 409,
    NamespaceShareError: 409,
    BodyTooLargeError: 413,
    InvalidRequestError: 422,
    InvalidSpecError: 422,
    BadCheckpointError: 422,
    UnavailableError: 503,
}

# Starlette's own errors (no route, wrong method, ...) get a code like ours.
_HTTP_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
}
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})
_MAX_LISTED = 5  # validation problems spelled out in one message


# The OpenAI-compatible routes answer a bad request 400, as OpenAI does, not 422.
OPENAI_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def http_status(exc: ApiError) -> int:
    return next(HTTP_STATUS[c] for c in type(exc).__mro__ if c in HTTP_STATUS)


def _openai_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(code: str, message: str, field: str | None, status: int) -> dict[str, Any]:
    detail = {"code": code, "message": message, "field": field}
    return {"error": {**detail, "type": _openai_type(status), "param": field}}


def error_json(
    code: str, message: str, field: str | None, status: int, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(code, message, field, status), status, headers=headers)


def _route_status(path: str, status: int) -> int:
    return 400 if status == 422 and path in OPENAI_PATHS else status


def error_response(
    exc: ApiError, headers: dict[str, str] | None = None, path: str = ""
) -> JSONResponse:
    """The error body with the error's status (400 for a 422 on an OpenAI route)."""
    return error_json(
        exc.code, exc.message, exc.field, _route_status(path, http_status(exc)), headers
    )


class ErrorDetail(BaseModel):
    code: str
    message: str
    field: str | None
    type: str  # OpenAI's error type: invalid_request_error, authentication_error, ...
    param: str | None  # OpenAI's name for `field`


class ErrorBody(BaseModel):
    error: ErrorDetail


def documented_errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` entry for a route that can answer these error statuses."""
    described = {
        401: "missing or wrong bearer token",
        404: "unknown experiment or model",
        409: "conflicting spec, or no free adapter slot",
        400: "malformed JSON; on the OpenAI routes also an invalid or unsupported field",
        422: "invalid request or spec; `field` names the offending field",
        503: "engine still loading",
    }
    return {c: {"model": ErrorBody, "description": described[c]} for c in codes}


def streamed_or_json(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``documented_errors`` for an OpenAI route, whose 200 is JSON or, with ``stream:
    true``, server-sent events."""
    events = {"text/event-stream": {"schema": {"type": "string"}}}
    return {200: {"content": events, "description": "JSON, or events when streaming"}} | (
        documented_errors(*codes)
    )


def _is_union_tag(part: str) -> bool:
    """pydantic puts the union member it tried into the location ("str", "list[str]")."""
    return "[" in part or part.startswith("constrained-") or part in _TYPE_TAGS


def _field_path(loc: tuple[Any, ...]) -> str | None:
    parts = list(loc)
    if parts and parts[0] in ("body", "path", "query", "header"):
        parts = parts[1:]
    parts = [p for p in parts if not (isinstance(p, str) and _is_union_tag(p))]
    if not parts:
        return None
    out = ""
    for p in parts:  # a map's key is a tenant's text: a prefix of it (echo.py)
        out += f"[{p}]" if isinstance(p, int) else (f".{clip(str(p))}" if out else str(p))
    return out


def _error_field(error: dict[str, Any]) -> str | None:
    loc = tuple(error.get("loc", ()))
    extra = (error.get("ctx") or {}).get("field")  # a model validator naming its field
    if isinstance(extra, str):
        loc = (*loc, extra)
    return _field_path(loc)


def _problem(error: dict[str, Any]) -> str:
    where = _error_field(error) or "body"
    msg = error.get("msg", "invalid")
    if error.get("type") == "extra_forbidden":
        msg = "unknown field"
    elif error.get("type") == "missing" and where == "body":
        msg = "a JSON object body is required"
    return f"{where}: {msg}"


def validation_response(exc: RequestValidationError, path: str = "") -> JSONResponse:
    """400 for a body that is not JSON; else 422 (400 on an OpenAI route) naming the
    first offending field."""
    errors = list(exc.errors())
    bad_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if bad_json is not None:
        detail = (bad_json.get("ctx") or {}).get("error", "invalid JSON")
        return error_json("invalid_json", f"malformed JSON body: {detail}", None, 400)
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    field = _error_field(first)
    messages = [_problem(e) for e in errors[:_MAX_LISTED]]
    if len(errors) > _MAX_LISTED:
        messages.append(f"... and {len(errors) - _MAX_LISTED} more")
    code = "invalid_spec" if field and field.split(".")[0].split("[")[0] == "spec" else None
    return error_json(
        code or "invalid_request", "; ".join(messages), field, _route_status(path, 422)
    )


def add_error_handlers(app: FastAPI) -> None:
    """Every error the app can raise leaves in the one error body."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        headers = getattr(exc, "headers", None)
        return error_json(code, str(exc.detail), None, exc.status_code, headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_json("internal", f"internal error ({type(exc).__name__})", None, 500)
