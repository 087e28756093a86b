"""The engine's HTTP API (docs/engine-api.md): a thin FastAPI layer over EngineService.

Everything here translates: JSON in, validated by pydantic; one call on the engine
(in a worker thread, since engine calls may wait for the running tick); JSON out.
Every error leaves as ``{"error": {"code", "message", "field"}}`` with a 4xx status, so
a client always learns what was wrong; only a bug in the engine gives a 500.

Auth is a pure ASGI middleware in front of the whole app: every path except the open
ones (health, readiness, metrics, the OpenAPI schema) needs ``Authorization: Bearer
<token>``, checked in constant time before routing, so a route added later cannot be
left open by mistake and a rejected request never reaches the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

import anyio
from fastapi import FastAPI, Path, Request, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from loraplex_engine.api_types import (
    RUN_ID_MAX_LENGTH,
    RUN_ID_PATTERN,
    Capacity,
    CheckpointRef,
    EngineService,
    ExperimentStatus,
)
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
from loraplex_engine.metrics import CONTENT_TYPE_LATEST, EngineMetrics
from loraplex_engine.spec import ExperimentSpec

log = logging.getLogger("loraplex_engine.server")

ID_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
NAMESPACE_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # DNS-1123 label: no dots
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json"})
MAX_PROMPTS = 16
MAX_N = 16
MAX_CHOICES = 64
MAX_PROMPT_CHARS = 8_192
DEFAULT_MAX_COMPLETION_TOKENS = 512
COMPLETION_THREADS = 32
MAX_BODY_BYTES = 4 * 1024 * 1024  # 16 prompts of 8192 characters, JSON-escaped, fit


ExpId = Annotated[
    str, Path(min_length=1, max_length=253, pattern=ID_PATTERN, description="experiment id")
]

# The HTTP status of every API error: the one place a status is chosen (errors.py knows
# nothing of HTTP). A class not listed answers its nearest listed base's status;
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


def http_status(exc: ApiError) -> int:
    return next(HTTP_STATUS[c] for c in type(exc).__mro__ if c in HTTP_STATUS)


def error_response(exc: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    """``{"error": {code, message, field}}`` with the error's status."""
    body = {"error": {"code": exc.code, "message": exc.message, "field": exc.field}}
    return JSONResponse(body, status_code=http_status(exc), headers=headers)


# --- request and response bodies ------------------------------------------------------


class _Strict(BaseModel):
    # No unknown fields, no coercion (true is not 1, "8" is not 8), as in the spec.
    model_config = ConfigDict(extra="forbid", strict=True)


class PutExperimentRequest(_Strict):
    spec: ExperimentSpec  # the LoRAExperiment spec, camelCase, strict (loraplex_engine.spec)
    namespace: str = Field("default", min_length=1, max_length=63, pattern=NAMESPACE_PATTERN)
    name: str = Field(min_length=1, max_length=253, pattern=ID_PATTERN)
    resumeFrom: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="checkpoint directory to resume from (shared checkpoint storage)",
    )
    runId: str | None = Field(
        None,
        min_length=1,
        max_length=RUN_ID_MAX_LENGTH,
        pattern=RUN_ID_PATTERN,
        description="the run: its checkpoints live in <root>/<namespace>/<name>/<runId>/; "
        "without resumeFrom its newest intact checkpoint is resumed, if it has one",
    )


class CompletionRequestBase(_Strict):
    model: str = Field(min_length=1, max_length=253, description="experiment id or base model")
    prompt: (
        Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
        | Annotated[
            list[Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]],
            Field(min_length=1, max_length=MAX_PROMPTS),
        ]
    )
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _bounded(self) -> CompletionRequestBase:
        prompts = 1 if isinstance(self.prompt, str) else len(self.prompt)
        if prompts * self.n > MAX_CHOICES:
            raise PydanticCustomError(
                "too_many_choices",
                "{prompts} prompt(s) x n={n} choices; at most {limit} in one request",
                {"prompts": prompts, "n": self.n, "limit": MAX_CHOICES, "field": "n"},
            )
        return self


class ErrorDetail(BaseModel):
    code: str
    message: str
    field: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


class ExperimentList(BaseModel):
    experiments: list[ExperimentStatus]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class HealthBody(BaseModel):
    status: str


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    described = {
        400: "malformed JSON",
        401: "missing or wrong bearer token",
        404: "unknown experiment or model",
        409: "conflicting spec, or no free adapter slot",
        422: "invalid request or spec; `field` names the offending field",
        503: "engine still loading",
    }
    return {c: {"model": ErrorBody, "description": described[c]} for c in codes}


# --- auth -----------------------------------------------------------------------------


class BearerAuth:
    """Rejects every non-open path without the right bearer token (constant-time)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = b""
            for key, value in scope["headers"]:
                if key == b"authorization":
                    given = value
                    break
            # Scheme is case-insensitive (RFC 7235); the token itself is compared exactly.
            if given[:7].lower() == b"bearer ":
                given = b"Bearer " + given[7:].strip()
            if not hmac.compare_digest(given, self.expected):
                error = UnauthorizedError("missing or wrong bearer token")
                response = error_response(error, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuses request bodies over ``max_bytes`` with 413 before they are read whole (by
    Content-Length, or by counting a chunked body as it arrives)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                length = int(value) if value.isdigit() else None
        if length is not None and length > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLargeError(f"request body over {self.max_bytes} bytes")
            return message

        await self.app(scope, counting_receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = BodyTooLargeError(f"request body over {self.max_bytes} bytes")
        await error_response(error)(scope, receive, send)


# --- the app --------------------------------------------------------------------------


def _is_union_tag(part: str) -> bool:
    """pydantic puts the union member it tried into the location ("str", "list[str]")."""
    return "[" in part or part.startswith("constrained-") or part in _TYPE_TAGS


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})


def _field_path(loc: tuple[Any, ...]) -> str | None:
    parts = list(loc)
    if parts and parts[0] in ("body", "path", "query", "header"):
        parts = parts[1:]
    # pydantic adds the union member ("str", "list[str]") to the location; not a field
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


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        e = next(e for e in errors if e.get("type") == "json_invalid")
        detail = (e.get("ctx") or {}).get("error", "invalid JSON")
        body = {"code": "invalid_json", "message": f"malformed JSON body: {detail}", "field": None}
        return JSONResponse({"error": body}, status_code=400)
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    field = _error_field(first)
    messages = []
    for e in errors[:5]:
        where = _error_field(e) or "body"
        msg = e.get("msg", "invalid")
        if e.get("type") == "extra_forbidden":
            msg = "unknown field"
        elif e.get("type") == "missing" and where == "body":
            msg = "a JSON object body is required"
        messages.append(f"{where}: {msg}")
    if len(errors) > 5:
        messages.append(f"... and {len(errors) - 5} more")
    code = "invalid_spec" if field and field.split(".")[0].split("[")[0] == "spec" else None
    body = {"code": code or "invalid_request", "message": "; ".join(messages), "field": field}
    return JSONResponse({"error": body}, status_code=422)


def create_app(
    engine: EngineService,
    token: str | None,
    *,
    metrics: EngineMetrics | None = None,
    on_work: Callable[[], None] | None = None,
    ready: Callable[[], bool] | None = None,
    alive: Callable[[], bool] | None = None,
    count_tokens: Callable[[str], int] | None = None,
    max_completion_tokens: int = DEFAULT_MAX_COMPLETION_TOKENS,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The HTTP app for ``engine``.

    token: the bearer token every non-open route needs; ``None`` disables auth (only
        ``serve --insecure-no-auth`` passes it).
    metrics: shared with the engine loop, which feeds it tick reports.
    on_work: called when a request gave the engine work (wakes an idle loop).
    ready / alive: readiness and liveness beyond ``engine.is_ready()``.
    count_tokens: token counter for ``usage`` in completions (default: the engine's
        ``tokenizer`` if it has one, else whitespace words).
    """
    metrics = metrics if metrics is not None else EngineMetrics()
    wake = on_work or (lambda: None)
    is_ready = ready or engine.is_ready
    is_alive = alive or (lambda: True)
    counter = count_tokens or _default_counter(engine)
    completion_limiter = anyio.CapacityLimiter(COMPLETION_THREADS)

    class CompletionRequest(CompletionRequestBase):
        # The engine's own limit, so the schema states it.
        max_tokens: int = Field(min(16, max_completion_tokens), ge=1, le=max_completion_tokens)

    app = FastAPI(
        title="loraplex engine",
        version="v1",
        description="One hot base model, many LoRA adapters trained with RL at once.",
        docs_url=None,
        redoc_url=None,
    )
    app.state.engine = engine
    app.state.metrics = metrics
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if token is not None:  # added last = outermost: nothing runs before the token check
        if not token:
            raise ValueError("empty token: pass None to serve without auth")
        app.add_middleware(BearerAuth, token=token)
    bearer = HTTPBearer(auto_error=False, description="the pool's engine token")
    v1 = {"dependencies": [Security(bearer)]}  # documents the scheme; BearerAuth enforces

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        codes = {
            400: "invalid_request",
            404: "not_found",
            405: "method_not_allowed",
            413: "too_large",
        }
        body = {"code": codes.get(exc.status_code, "http_error"), "message": str(exc.detail)}
        return JSONResponse(
            {"error": {**body, "field": None}},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        body = {"code": "internal", "message": f"internal error ({type(exc).__name__})"}
        return JSONResponse({"error": {**body, "field": None}}, status_code=500)

    # --- open routes ---

    @app.get("/healthz", response_model=HealthBody, tags=["probes"])
    def healthz() -> JSONResponse:
        """Process alive (200 also while the model loads); 503 if the engine loop died."""
        if not is_alive():
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get(
        "/readyz",
        response_model=HealthBody,
        responses={503: {"model": HealthBody, "description": "loading"}},
        tags=["probes"],
    )
    def readyz() -> JSONResponse:
        """Model loaded and engine loop running."""
        if is_alive() and is_ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
        tags=["probes"],
    )
    def prometheus_metrics() -> Response:
        """Prometheus text format (docs/metrics.md)."""
        if is_ready():
            try:
                metrics.update_capacity(engine.capacity())
                metrics.sync_experiments(engine.list_experiments())
            except ApiError:
                pass
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # --- /v1 ---

    def _ready_engine() -> EngineService:
        if not is_ready():
            raise UnavailableError("the engine is still loading")
        return engine

    @app.get("/v1/capacity", response_model=Capacity, responses=_errors(401, 503), **v1)
    def capacity() -> dict[str, Any]:
        """Adapter slots, max rank and memory."""
        cap = _ready_engine().capacity()
        metrics.update_capacity(cap)
        return cap.to_json()

    @app.put(
        "/v1/experiments/{id}",
        response_model=ExperimentStatus,
        status_code=200,
        responses={
            201: {"model": ExperimentStatus, "description": "started (or resumed)"},
            **_errors(400, 401, 409, 422, 503),
        },
        **v1,
    )
    def put_experiment(id: ExpId, body: PutExperimentRequest) -> JSONResponse:
        """Start an experiment, or resume it from `resumeFrom` (or, given only `runId`, from
        that run's newest checkpoint). Idempotent: the same spec again answers 200; a
        different spec or run for a loaded id answers 409."""
        status, created = _ready_engine().put_experiment(
            id, body.spec, body.namespace, body.name, body.resumeFrom, body.runId
        )
        metrics.track(status.id, status.namespace)
        wake()
        return JSONResponse(status.to_json(), status_code=201 if created else 200)

    @app.get("/v1/experiments", response_model=ExperimentList, responses=_errors(401, 503), **v1)
    def list_experiments() -> dict[str, Any]:
        """Every loaded experiment."""
        return {"experiments": [s.to_json() for s in _ready_engine().list_experiments()]}

    @app.get(
        "/v1/experiments/{id}",
        response_model=ExperimentStatus,
        responses=_errors(401, 404, 422, 503),
        **v1,
    )
    def get_experiment(id: ExpId) -> dict[str, Any]:
        """One experiment's status."""
        return _ready_engine().get_experiment(id).to_json()

    @app.post(
        "/v1/experiments/{id}/checkpoint",
        response_model=CheckpointRef,
        responses=_errors(401, 404, 422, 503),
        **v1,
    )
    def checkpoint(id: ExpId) -> dict[str, Any]:
        """Write a checkpoint now."""
        eng = _ready_engine()
        ref = eng.checkpoint_experiment(id)
        ns = metrics.tracked().get(id)
        if ns is not None:
            metrics.count_checkpoint(id, ns)
        return ref.to_json()

    @app.delete(
        "/v1/experiments/{id}",
        response_model=ExperimentStatus,
        responses=_errors(401, 404, 422, 503),
        **v1,
    )
    def delete_experiment(id: ExpId) -> dict[str, Any]:
        """Checkpoint, then unload and free the slot; answers the final status."""
        status = _ready_engine().remove_experiment(id)
        metrics.forget(id)
        return status.to_json()

    async def completions(body: CompletionRequestBase) -> dict[str, Any]:
        """OpenAI completions subset. `model` is an experiment id (its current adapter)
        or the base model's name; served in the engine's next rollout batch."""
        eng = await run_in_threadpool(_ready_engine)
        prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)

        async def one(prompt: str) -> list[str]:
            return await anyio.to_thread.run_sync(
                eng.complete,
                body.model,
                prompt,
                body.max_tokens,
                body.temperature,
                body.n,
                limiter=completion_limiter,
            )

        tasks = [asyncio.ensure_future(one(p)) for p in prompts]
        wake()
        try:
            results = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        choices = []
        completion_tokens = 0
        for texts in results:
            for text in texts:
                used = counter(text)
                completion_tokens += used
                reason = "length" if used >= body.max_tokens else "stop"
                choices.append({"index": len(choices), "text": text, "finish_reason": reason})
        prompt_tokens = sum(counter(p) for p in prompts)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    # The body type is local to this app (its max_tokens limit); annotations here are
    # strings that FastAPI would resolve in the module, so set the real class.
    completions.__annotations__["body"] = CompletionRequest
    app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses=_errors(400, 401, 404, 422, 503),
        **v1,
    )(completions)

    return app


def _default_counter(engine: EngineService) -> Callable[[str], int]:
    """Counts with the engine's tokenizer when it has one (looked up per call: the engine
    may still be loading when the app is built), else whitespace-separated words."""

    def count(text: str) -> int:
        tokenizer = getattr(engine, "tokenizer", None)
        if tokenizer is not None and callable(getattr(tokenizer, "encode", None)):
            return len(tokenizer.encode(text, add_special_tokens=False))
        return len(text.split())

    return count


def v1_routes(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every /v1 route, for tests that must cover them all."""
    out = []
    for route in app.routes:
        path = getattr(route, "path", "")
        if path.startswith("/v1"):
            for method in sorted(getattr(route, "methods", ()) or ()):
                if method != "HEAD":
                    out.append((method, path))
    return out
