"""The Tinker routes, ``/api/v1/...``, on the engine's own app and port (mounted by
server/app.py when ``serve --tinker-keys`` is given). The SDK's request shapes are
checked by the pydantic models below (unknown fields ignored, as the SDK adds them
over time); each route authenticates its ``X-API-Key`` to a namespace and hands the
request to :class:`~loraplex_engine.server.tinker.protocol.Protocol`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from loraplex_engine.server.tinker import rest
from loraplex_engine.server.tinker.checkpoint_routes import TtlSeconds, add_checkpoint_routes
from loraplex_engine.server.tinker.errors import add_protocol_error_handler, as_api_error
from loraplex_engine.server.tinker.future_routes import add_future_routes
from loraplex_engine.server.tinker.future_table import FutureLimits, FutureTable
from loraplex_engine.server.tinker.futures import Runner
from loraplex_engine.server.tinker.gauges import export_tinker_gauges
from loraplex_engine.server.tinker.journal import find_future
from loraplex_engine.server.tinker.json_bodies import off_loop_json_route
from loraplex_engine.server.tinker.keys import AdminDelegation, KeyStore
from loraplex_engine.server.tinker.metadata import check_metadata
from loraplex_engine.server.tinker.protocol import Protocol
from loraplex_engine.server.tinker.rest import Ns
from loraplex_engine.server.tinker.state import Registry
from loraplex_engine.server.tinker.wire import PROTOBUF
from loraplex_engine.spec.errors import (
    ConflictError,
    InvalidRequestError,
    NoCapacityError,
    NotFoundError,
)
from loraplex_engine.spec.tinker_limits import DEFAULT_MAX_SESSIONS, RecordLimits
from loraplex_engine.spec.training_service import TrainingService

PREFIX = "/api/v1"
# The calls the engine queues detached (it answers them; the SDK fetches the answer).
DETACHED = frozenset({"Forward", "ForwardBackward", "OptimStep"})
LONG_POLL_S = 10.0  # a retrieve_future of a pending future waits this long for it
OPEN = frozenset({f"{PREFIX}/healthz"})

# What the SDK asks at start-up (ClientConfigResponse): API keys, not JWT exchange;
# forward_backward as protobuf, zstd compressed (chunks under the body limit);
# samples' futures polled per sampling session (future_routes.py), others one by one;
# custom losses run on the client.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "proto_compress_fwdbwd": True,
    "parallel_fwdbwd_chunks": True,
    "fwdbwd_max_chunk_len": 256,
    "fwdbwd_max_chunk_bytes_count": 2_000_000,
    "use_pyqwest_transport": False,
    "sample_use_retrieve_futures": True,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


# Kept as long as its session lives: bounded (server/tinker/metadata.py), a 422 naming it past that.
Metadata = Annotated[dict[str, Any] | None, AfterValidator(check_metadata)]


class CreateSession(Body):
    tags: list[str] = []
    user_metadata: Metadata = None
    sdk_version: str = ""


class SessionRef(Body):
    session_id: str = Field(min_length=1, max_length=200)


class Lora(Body):
    rank: int = Field(ge=1)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModel(SessionRef):
    model_seq_id: int = Field(ge=0)
    base_model: str
    user_metadata: Metadata = None
    lora_config: Lora | None = None
    optimizer_config: dict[str, Any] | None = None


class ModelRef(Body):
    model_id: str = Field(min_length=1, max_length=300)
    seq_id: int | None = None


class OptimStep(ModelRef):
    adam_params: dict[str, Any] | None = None
    optim_params: dict[str, Any] | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeights(ModelRef):
    path: str | None = None
    kind: str = "snapshot"
    sampling_session_seq_id: int | None = None
    ttl_seconds: TtlSeconds = None


class LoadWeights(Body):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: Metadata = None
    path: str = Field(min_length=1, max_length=4096)
    optimizer: bool = False
    optimizer_config: dict[str, Any] | None = None


class CreateSampler(SessionRef):
    sampling_session_seq_id: int | None = None
    base_model: str | None = None
    model_path: str | None = None


class Sample(Body):
    num_samples: int = 1
    prompt: dict[str, Any]
    sampling_params: dict[str, Any] = {}
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: Any = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: Any = None  # checked strictly by sampling_params.py
    record_stability_info: bool | None = None


class Retrieve(Body):
    request_id: str = Field(min_length=1, max_length=200)
    allow_metadata_only: bool = False


async def call(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs ``fn`` off the event loop (it may wait for the engine); an engine error that
    would answer 409 answers 4xx/503 instead (the SDK retries a 409 for minutes)."""
    try:
        return await run_in_threadpool(fn, *args)
    except NoCapacityError as e:
        raise as_api_error(e) from None
    except ConflictError as e:
        raise InvalidRequestError(e.message, e.field) from None


# forward_backward bodies are decoded (zstd, protobuf), and big JSON bodies parsed
# (json_bodies.py), on at most this many threads at once, never on the event loop: a body
# that expands to megabytes costs a decode thread, not every tenant's /healthz and polls.
# More wait their turn (holding only their body).
MAX_DECODES = 2


async def decode_call(limiter: anyio.CapacityLimiter, fn: Callable[..., Any], *args: Any) -> Any:
    """:func:`call` on one of the ``limiter``'s decode threads."""
    try:
        return await anyio.to_thread.run_sync(lambda: fn(*args), limiter=limiter)
    except NoCapacityError as e:
        raise as_api_error(e) from None
    except ConflictError as e:
        raise InvalidRequestError(e.message, e.field) from None


def at_once(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs ``fn`` on the event loop, for protocol calls that only check, decode and
    queue (they never wait for the engine): no hop to a worker thread, which costs more
    than the call and, while the tick thread holds the GIL, waits for it. Errors as
    :func:`call` maps them."""
    try:
        return fn(*args)
    except NoCapacityError as e:
        raise as_api_error(e) from None
    except ConflictError as e:
        raise InvalidRequestError(e.message, e.field) from None


def future_answer(request_id: str, model_id: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"request_id": request_id, "model_id": model_id, **extra}


def mount_tinker(
    app: FastAPI,
    training: Callable[[], TrainingService],
    keys: KeyStore | None,
    *,
    admin_token: str | None = None,
    registry: Registry | None = None,
    futures: FutureTable | None = None,
    future_limits: FutureLimits | None = None,
    record_limits: RecordLimits | None = None,
    runner: Runner | None = None,
    long_poll_s: float = LONG_POLL_S,
    max_sessions: int = DEFAULT_MAX_SESSIONS,
    served_names: tuple[str, ...] = (),
    unlisted_names: tuple[str, ...] = (),
) -> Protocol:
    """Adds the ``/api/v1`` routes to ``app``; returns the protocol state. Requests
    authenticate with ``keys`` (a tenant's ``X-API-Key``) or ``admin_token`` (the engine's
    admin token acting for ``X-Loraplex-Namespace``); at least one is given."""
    delegation = AdminDelegation(admin_token) if admin_token else None
    if keys is None and delegation is None:
        raise ValueError("the Tinker routes need tenant keys or the admin token")
    registry = registry or Registry(max_sessions=max_sessions)
    futures = futures if futures is not None else FutureTable(future_limits)
    proto = Protocol(
        training,
        registry=registry,
        futures=futures,
        runner=runner,
        served_names=served_names,
        unlisted_names=unlisted_names,
        records=record_limits,
    )
    decodes = anyio.CapacityLimiter(MAX_DECODES)
    app.state.tinker = proto
    metrics = getattr(app.state, "metrics", None)  # the engine's (server/app.py)
    if metrics is not None:
        export_tinker_gauges(metrics.registry, proto.stability.recorder)
    add_protocol_error_handler(app)

    app.state.tinker_keys = keys  # tenants' own keys (serve --tinker-keys), or None
    app.state.tinker_delegation = delegation  # the gateway's way in, or None
    r = APIRouter(prefix=PREFIX, tags=["tinker"], route_class=off_loop_json_route(decodes))

    @r.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @r.post("/client/config")
    def client_config(_: Ns) -> dict[str, Any]:
        return CLIENT_CONFIG

    @r.post("/client/dynamic_config")
    def dynamic_config(_: Ns) -> dict[str, Any]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": True}

    @r.post("/telemetry")
    async def telemetry(_: Ns) -> dict[str, str]:
        return {"status": "accepted"}  # accepted and dropped

    @r.get("/get_server_capabilities")
    async def capabilities(_: Ns) -> dict[str, Any]:
        names = await call(proto.served_names)
        models = [{"model_name": n, "trainable": True, "sampleable": True} for n in names]
        return {"supported_models": models}

    @r.post("/create_session")
    def create_session(ns: Ns, body: CreateSession) -> dict[str, Any]:
        session = proto.registry.new_session(ns, body.user_metadata)
        return {"type": "create_session", "session_id": session.id}

    @r.post("/session_heartbeat")
    def heartbeat(ns: Ns, body: SessionRef) -> dict[str, str]:
        proto.registry.session(ns, body.session_id)
        return {"type": "session_heartbeat"}

    @r.post("/sessions/{session_id}/finish")
    def finish(ns: Ns, session_id: str) -> dict[str, Any]:
        proto.end_session(ns, session_id)
        return {}

    @r.post("/create_model")
    async def create_model(ns: Ns, body: CreateModel) -> dict[str, Any]:
        rid = await call(proto.create_model, ns, body.model_dump())
        return future_answer(rid)

    @r.post("/get_info")
    async def get_info(ns: Ns, body: ModelRef) -> dict[str, Any]:
        model = proto.registry.model(ns, body.model_id)
        info = await call(lambda: training().model_info(ns, model.id))
        return {
            "type": "get_info",
            "model_id": model.id,
            "model_name": info.base_model,
            "model_data": {"model_name": info.base_model, "tokenizer_id": info.tokenizer_id},
            "is_lora": True,
            "lora_rank": info.lora.rank,
            "optimizer_config": {"type": "adamw"},
        }

    @r.post("/forward_backward")
    async def forward_backward(ns: Ns, request: Request) -> dict[str, Any]:
        kind = request.headers.get("content-type", "").split(";")[0].strip()
        if kind != PROTOBUF:
            raise InvalidRequestError(f"forward_backward takes {PROTOBUF}, not {kind!r}")
        body = await request.body()
        encoding = request.headers.get("content-encoding")
        return future_answer(await decode_call(decodes, proto.forward_backward, ns, body, encoding))

    @r.post("/forward")
    async def forward(ns: Ns, request: Request) -> dict[str, Any]:
        return await forward_backward(ns, request)

    @r.post("/optim_step")
    async def optim_step(ns: Ns, body: OptimStep) -> dict[str, Any]:
        return future_answer(at_once(proto.optim_step, ns, body.model_dump()))

    @r.post("/save_weights")
    async def save_weights(ns: Ns, body: SaveWeights) -> dict[str, Any]:
        return future_answer(await call(proto.save_weights, ns, body.model_dump()))

    @r.post("/save_weights_for_sampler")
    async def save_for_sampler(ns: Ns, body: SaveWeights) -> dict[str, Any]:
        rid = await call(proto.save_weights_for_sampler, ns, body.model_dump())
        return future_answer(rid)

    @r.post("/load_weights")
    async def load_weights(ns: Ns, body: LoadWeights) -> dict[str, Any]:
        return future_answer(await call(proto.load_weights, ns, body.model_dump()))

    @r.post("/unload_model")
    async def unload_model(ns: Ns, body: ModelRef) -> dict[str, Any]:
        return future_answer(await call(proto.unload_model, ns, body.model_dump()))

    @r.post("/create_sampling_session")
    async def create_sampler(ns: Ns, body: CreateSampler) -> dict[str, Any]:
        sampler = await call(proto.create_sampler, ns, body.model_dump())
        return {"type": "create_sampling_session", "sampling_session_id": sampler.id}

    @r.get("/samplers/{sampler_id}")
    def get_sampler(ns: Ns, sampler_id: str) -> dict[str, Any]:
        s = proto.registry.sampler(ns, sampler_id)
        return {"sampler_id": s.id, "base_model": s.base_model, "model_path": s.model_path}

    @r.post("/asample")
    async def asample(ns: Ns, body: Sample) -> dict[str, Any]:
        fut = await call(proto.sample, ns, body.model_dump())
        return future_answer(fut.request_id, sample_sequence_ids=fut.sample_sequence_ids)

    @r.post("/create_custom_loss")
    def create_custom_loss(_: Ns) -> dict[str, Any]:
        raise InvalidRequestError(
            "server-side custom losses are not supported: forward_backward_custom runs the "
            "loss on the client (custom_loss_server_side is false)",
            field="graph",
        )

    @r.post("/retrieve_future")
    async def retrieve_future(ns: Ns, body: Retrieve) -> Response:
        fut = await call(find_future, proto, ns, body.request_id)
        if fut is None:
            raise NotFoundError(
                f"no request {body.request_id!r} (unknown, or its result has expired)",
                field="request_id",
            )
        if fut.state in ("pending", "paused_capacity"):
            await fut.changed(fut.state, long_poll_s)
        if fut.state in ("done", "failed"):
            proto.futures.retrieved(fut)  # its client has it: dropped after a grace
            if fut.kind in DETACHED and fut.model_id:
                await call(answer_fetched, training, ns, fut.model_id)
        if fut.state == "done":
            if isinstance(fut.result, bytes):
                return Response(fut.result, media_type=PROTOBUF)
            return JSONResponse(fut.result)
        if fut.state == "failed":
            return JSONResponse({"error": fut.error, "category": fut.category})
        answer = {"type": "try_again", "request_id": fut.request_id, "queue_state": "active"}
        if fut.state == "paused_capacity":
            reason = f"every adapter slot of the engine is taken ({fut.error}); waiting"
            answer |= {"queue_state": "paused_capacity", "queue_state_reason": reason}
        # 408: the SDK polls again quietly (a 200 try_again logs a warning per poll).
        return JSONResponse(answer, status_code=408)

    rest.add_rest_routes(r, proto, call)
    add_future_routes(r, proto, long_poll_s)
    add_checkpoint_routes(r, proto, call)

    @r.api_route("/{route:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    def unsupported(_: Ns, route: str, request: Request) -> None:
        raise NotFoundError(
            f"{request.method} {PREFIX}/{route} is not supported by this engine "
            "(docs/tinker.md lists the Tinker calls it serves)",
            field="path",
        )

    app.include_router(r)
    return proto


def answer_fetched(training: Callable[[], TrainingService], ns: str, model_id: str) -> None:
    """Tell the engine a model's answer is with its client (the gather waits for a
    client's next call only once it holds every answer: clients/gather.py)."""
    fetched = getattr(training(), "retrieved", None)
    if fetched is not None:
        fetched(ns, model_id)
