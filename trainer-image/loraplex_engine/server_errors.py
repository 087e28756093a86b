"""How the HTTP API reports errors: ``{"error": {"code", "message", "field"}}``, 4xx.

The one place an HTTP status is chosen for an :class:`ApiError` (errors.py knows nothing
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

from loraplex_engine.errors import (
    ApiError,
    BadCheckpointError,
    BodyTooLargeError,
    ConflictError,
    InvalidRequestError,
    InvalidSpecError,
    NoCapacityError,
    NotFoundError,
    UnauthorizedError,
    UnavailableError,
)

log = logging.getLogger("loraplex_engine.server")

# A class not listed answers its nearest listed base's status;
# tests/engine/test_errors.py requires every ApiError subclass to be listed.
HTTP_STATUS: dict[type[ApiError], int] = {
    ApiError: 400,
    UnauthorizedError: 401,
    NotFoundError: 404,
    ConflictError: 409,
    NoCapacityError: 409,
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


def http_status(exc: ApiError) -> int:
    return next(HTTP_STATUS[c] for c in type(exc).__mro__ if c in HTTP_STATUS)


def error_response(exc: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    """``{"error": {code, message, field}}`` with the error's status."""
    body = {"error": {"code": exc.code, "message": exc.message, "field": exc.field}}
    return JSONResponse(body, status_code=http_status(exc), headers=headers)


class ErrorDetail(BaseModel):
    code: str
    message: str
    field: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


def documented_errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` entry for a route that can answer these error statuses."""
    described = {
        400: "malformed JSON",
        401: "missing or wrong bearer token",
        404: "unknown experiment or model",
        409: "conflicting spec, or no free adapter slot",
        422: "invalid request or spec; `field` names the offending field",
        503: "engine still loading",
    }
    return {c: {"model": ErrorBody, "description": described[c]} for c in codes}


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
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
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


def validation_response(exc: RequestValidationError) -> JSONResponse:
    """400 for a body that is not JSON; else 422 naming the first offending field."""
    errors = list(exc.errors())
    bad_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if bad_json is not None:
        detail = (bad_json.get("ctx") or {}).get("error", "invalid JSON")
        body = {"code": "invalid_json", "message": f"malformed JSON body: {detail}", "field": None}
        return JSONResponse({"error": body}, status_code=400)
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    field = _error_field(first)
    messages = [_problem(e) for e in errors[:_MAX_LISTED]]
    if len(errors) > _MAX_LISTED:
        messages.append(f"... and {len(errors) - _MAX_LISTED} more")
    code = "invalid_spec" if field and field.split(".")[0].split("[")[0] == "spec" else None
    body = {"code": code or "invalid_request", "message": "; ".join(messages), "field": field}
    return JSONResponse({"error": body}, status_code=422)


def add_error_handlers(app: FastAPI) -> None:
    """Every error the app can raise leaves in the one error body."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        return JSONResponse(
            {"error": {"code": code, "message": str(exc.detail), "field": None}},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        body = {"code": "internal", "message": f"internal error ({type(exc).__name__})"}
        return JSONResponse({"error": {**body, "field": None}}, status_code=500)
