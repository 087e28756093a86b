"""The engine's HTTP API (docs/engine-api.md): a thin FastAPI layer over EngineService
(spec/service.py).

Everything here translates: JSON in, validated by pydantic; one call on the engine
(in a worker thread, since engine calls may wait for the running tick); JSON out.
Errors leave as ``{"error": {"code", "message", "field", "type", "param"}}``
(server/errors.py); every path except the open ones needs the bearer token
(server/middleware.py); the OpenAI routes (server/openai/completions.py, server/openai/chat.py,
server/openai/models.py) are served from the engine's rollout queue.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import FastAPI, Path, Request, Security
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from loraplex_engine.metrics import CONTENT_TYPE_LATEST, EngineMetrics
from loraplex_engine.server.errors import add_error_handlers, documented_errors
from loraplex_engine.server.metrics_access import sees_tenants, tenant_free
from loraplex_engine.server.middleware import BearerAuth, BodyLimit
from loraplex_engine.server.observe import Observe
from loraplex_engine.server.openai.chat import add_chat_route
from loraplex_engine.server.openai.completions import add_completions_route
from loraplex_engine.server.openai.models import add_models_routes
from loraplex_engine.spec.api_types import (
    DEFAULT_MAX_COMPLETION_TOKENS,
    RUN_ID_MAX_LENGTH,
    RUN_ID_PATTERN,
    Capacity,
    CheckpointRef,
    ExperimentStatus,
    VersionSummary,
)
from loraplex_engine.spec.errors import ApiError, InvalidRequestError, UnavailableError
from loraplex_engine.spec.experiment import ExperimentSpec
from loraplex_engine.spec.publish import PublishSpec
from loraplex_engine.spec.service import EngineService
from loraplex_engine.spec.tinker_limits import DEFAULT_MAX_SESSIONS

ID_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
NAMESPACE_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # DNS-1123 label: no dots
MAX_BODY_BYTES = 4 * 1024 * 1024  # 16 prompts of 8192 characters, JSON-escaped, fit
TINKER_PREFIX = "/api/v1"  # the Tinker protocol's routes (server/tinker/routes.py)


ExpId = Annotated[
    str, Path(min_length=1, max_length=253, pattern=ID_PATTERN, description="experiment id")
]


# --- request and response bodies ------------------------------------------------------


class PublishRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    publish: PublishSpec | None  # spec.publish, as in the LoRAExperiment (null: none)


class PutExperimentRequest(BaseModel):
    # No unknown fields, no coercion (true is not 1, "8" is not 8), as in the spec.
    model_config = ConfigDict(extra="forbid", strict=True)

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


class ExperimentList(BaseModel):
    experiments: list[ExperimentStatus]


class HealthBody(BaseModel):
    status: str


# --- the app --------------------------------------------------------------------------


def create_app(
    engine: EngineService,
    token: str | None,
    *,
    metrics: EngineMetrics | None = None,
    on_work: Callable[[], None] | None = None,
    ready: Callable[[], bool] | None = None,
    alive: Callable[[], bool] | None = None,
    max_completion_tokens: int = DEFAULT_MAX_COMPLETION_TOKENS,
    max_body_bytes: int = MAX_BODY_BYTES,
    tinker_keys: Any = None,
    training: Callable[[], Any] | None = None,
    tinker_max_sessions: int = DEFAULT_MAX_SESSIONS,
    tinker_futures: Any = None,
    tinker_records: Any = None,
    served_names: tuple[str, ...] = (),
    unlisted_names: tuple[str, ...] = (),
) -> FastAPI:
    """The HTTP app for ``engine``.

    token: the bearer token every non-open route needs; ``None`` disables auth (only
        ``serve --insecure-no-auth`` passes it).
    metrics: shared with the engine loop, which feeds it tick reports.
    on_work: called when a request gave the engine work (wakes an idle loop).
    ready / alive: readiness and liveness beyond ``engine.is_ready()``.
    tinker_keys / training: with ``training`` (the engine's ``TrainingService``, a
        getter: it raises ``UnavailableError`` until the engine has loaded) the Tinker
        protocol is served under ``/api/v1`` (server/tinker/routes.py) to ``tinker_keys`` (a
        ``tinker.keys.KeyStore``: tenants' API keys, each a namespace) and to ``token``
        acting for the namespace in ``X-Loraplex-Namespace`` (the gateway's way in).
    tinker_max_sessions: open Tinker sessions a namespace may hold at once.
    tinker_futures: the Tinker futures' bounds (a ``server.tinker.future_table.FutureLimits``).
    tinker_records: the bounds of samples recorded for stable_reinforce (a
        ``server.tinker.recorded.RecordLimits``).
    served_names: more names a Tinker client may call the base model by (serve
        --served-model-name; base_model.served_names), besides ``engine.model_name``;
        ``unlisted_names`` are accepted too, but not listed (the model directory's name).
    """
    metrics = metrics if metrics is not None else EngineMetrics()
    wake = on_work or (lambda: None)
    is_ready = ready or engine.is_ready
    is_alive = alive or (lambda: True)
    app = FastAPI(
        title="loraplex engine",
        version="v1",
        description="One hot base model, many LoRA adapters trained with RL at once.",
        docs_url=None,
        redoc_url=None,
    )
    app.state.engine = engine
    app.state.metrics = metrics
    metrics.set_base_model(engine.model_name)  # again on each scrape: a loaded engine's
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if token is not None:  # added last = outermost: nothing runs before the token check
        if not token:
            raise ValueError("empty token: pass None to serve without auth")
        tenant = TINKER_PREFIX + "/" if training is not None else None
        app.add_middleware(BearerAuth, token=token, tenant_prefix=tenant)
    app.add_middleware(Observe, metrics=metrics)  # outermost: refused requests are logged too
    bearer = HTTPBearer(auto_error=False, description="the pool's engine token")
    v1 = {"dependencies": [Security(bearer)]}  # documents the scheme; BearerAuth enforces

    add_error_handlers(app)

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
    def prometheus_metrics(request: Request) -> Response:
        """Prometheus text format (docs/metrics.md); tenants' series only with the token
        (server/metrics_access.py)."""
        if is_ready():
            try:
                metrics.update_capacity(engine.capacity())
                metrics.sync_experiments(engine.list_experiments())
                metrics.set_base_model(engine.model_name)
                # Completions waiting for a serving tick (a list's length: no lock).
                metrics.set_serving_queue(getattr(engine, "queued_completions", 0))
            except ApiError:
                pass
        if sees_tenants(request.headers.get("authorization"), token):
            return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
        return Response(tenant_free(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # --- /v1 ---

    def _ready_engine() -> EngineService:
        if not is_ready():
            raise UnavailableError("the engine is still loading")
        return engine

    @app.get("/v1/capacity", response_model=Capacity, responses=documented_errors(401, 503), **v1)
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
            **documented_errors(400, 401, 409, 422, 503),
        },
        **v1,
    )
    def put_experiment(id: ExpId, body: PutExperimentRequest) -> JSONResponse:
        """Start an experiment, or resume it from `resumeFrom` (or, given only `runId`, from
        that run's newest checkpoint). Idempotent: the same spec again answers 200; a
        different spec or run for a loaded id answers 409. The id must be the body's
        `<namespace>.<name>`: a request about one experiment never reaches another's
        checkpoints."""
        expected = f"{body.namespace}.{body.name}"
        if id != expected:
            raise InvalidRequestError(
                f"experiment id {id!r} must equal <namespace>.<name> of the body, {expected!r}",
                field="name",
            )
        status, created = _ready_engine().put_experiment(
            id, body.spec, body.namespace, body.name, body.resumeFrom, body.runId
        )
        metrics.track(status.id, status.namespace)
        wake()
        return JSONResponse(status.to_json(), status_code=201 if created else 200)

    @app.get(
        "/v1/experiments",
        response_model=ExperimentList,
        responses=documented_errors(401, 503),
        **v1,
    )
    def list_experiments() -> dict[str, Any]:
        """Every loaded experiment."""
        return {"experiments": [s.to_json() for s in _ready_engine().list_experiments()]}

    @app.get(
        "/v1/experiments/{id}",
        response_model=ExperimentStatus,
        responses=documented_errors(401, 404, 422, 503),
        **v1,
    )
    def get_experiment(id: ExpId) -> dict[str, Any]:
        """One experiment's status."""
        return _ready_engine().get_experiment(id).to_json()

    @app.post(
        "/v1/experiments/{id}/checkpoint",
        response_model=CheckpointRef,
        responses=documented_errors(401, 404, 422, 503),
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

    @app.post(
        "/v1/experiments/{id}/versions",
        response_model=VersionSummary,
        status_code=201,
        responses=documented_errors(401, 404, 422, 503),
        **v1,
    )
    def publish_version(id: ExpId) -> dict[str, Any]:
        """Publish the adapter now as the experiment's next version (docs/versions.md);
        its aliases follow as on a scheduled publish."""
        return _ready_engine().publish_version(id).to_json()

    @app.put(
        "/v1/experiments/{id}/publish",
        response_model=ExperimentStatus,
        responses=documented_errors(401, 404, 422, 503),
        **v1,
    )
    def update_publish(id: ExpId, body: PublishRequest) -> dict[str, Any]:
        """Replace the experiment's spec.publish in place (aliases: promotion, rollback;
        pins; the policy): it trains on, and its aliases move at once."""
        return _ready_engine().update_publish(id, body.publish).to_json()

    @app.delete(
        "/v1/experiments/{id}",
        response_model=ExperimentStatus,
        responses=documented_errors(401, 404, 422, 503),
        **v1,
    )
    def delete_experiment(id: ExpId) -> dict[str, Any]:
        """Checkpoint, then unload and free the slot; answers the final status."""
        status = _ready_engine().remove_experiment(id)
        metrics.forget(id)
        return status.to_json()

    openai = {"wake": wake, "max_completion_tokens": max_completion_tokens, "route_options": v1}
    add_completions_route(app, _ready_engine, **openai)
    add_chat_route(app, _ready_engine, **openai)
    add_models_routes(app, _ready_engine, v1)

    if training is not None and (tinker_keys is not None or token):
        # Imported only here: the protocol's wire needs numpy and the tinker SDK's protobuf.
        from loraplex_engine.server.tinker.routes import mount_tinker

        mount_tinker(
            app,
            training,
            tinker_keys,
            admin_token=token,
            future_limits=tinker_futures,
            record_limits=tinker_records,
            max_sessions=tinker_max_sessions,
            served_names=served_names,
            unlisted_names=unlisted_names,
        )

    return app
