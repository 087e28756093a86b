"""The SDK's REST reads (``tinker.RestClient``): training runs and checkpoints of the
caller's namespace, paginated, and the authentication every Tinker route uses.

A training run is a model the namespace created here: loaded now
(``TrainingService.list_models``) or known by its saved checkpoints (``list_saved``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from loraplex_engine.server.tinker.keys import NAMESPACE_HEADER
from loraplex_engine.spec.errors import NotFoundError, UnauthorizedError
from loraplex_engine.spec.training_service import SavedState

if TYPE_CHECKING:
    from loraplex_engine.server.tinker.protocol import Protocol


async def namespace(request: Request) -> str:
    """The namespace of the request's ``X-API-Key`` (the header the SDK sends), or, from
    a gateway, the one ``X-Loraplex-Namespace`` names beside the admin bearer token.
    On the event loop (``async``): a hash and a compare per key, and a file stat at most
    once a second, cost less than the hop to a worker thread a sync dependency takes,
    which under a busy tick thread waits for the GIL (docs/benchmarks.md, issue 28)."""
    headers = request.headers
    if NAMESPACE_HEADER in headers:
        delegation = request.app.state.tinker_delegation
        ns = None
        if delegation is not None:
            ns = delegation.namespace_for(headers.get("authorization"), headers[NAMESPACE_HEADER])
        if ns is None:
            raise UnauthorizedError(
                "X-Loraplex-Namespace needs the engine's admin token and a DNS-1123 label"
            )
        return ns
    keys = request.app.state.tinker_keys
    ns = keys.namespace_of(headers.get("x-api-key")) if keys is not None else None
    if ns is None:
        raise UnauthorizedError("missing or unknown API key (X-API-Key: tml-...)")
    return ns


Ns = Annotated[str, Depends(namespace)]
Limit = Annotated[int, Query(ge=1, le=1000)]
Offset = Annotated[int, Query(ge=0)]
_KIND = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, UTC).isoformat()


def checkpoint(saved: SavedState) -> dict[str, Any]:
    return {
        "checkpoint_id": f"{saved.kind}/{saved.name}",
        "checkpoint_type": _KIND[saved.kind],
        "time": _iso(saved.created),
        "tinker_path": saved.path,
        "size_bytes": saved.size_bytes,
        "public": False,
        "expires_at": None if saved.expires is None else _iso(saved.expires),
    }


def _latest(saved: list[SavedState], kind: str) -> dict[str, Any] | None:
    of_kind = [s for s in saved if s.kind == kind]
    return checkpoint(max(of_kind, key=lambda s: s.created)) if of_kind else None


def training_runs(proto: Protocol, ns: str) -> list[dict[str, Any]]:
    svc = proto.training()
    loaded = {m.model_id: m for m in svc.list_models(ns)}
    saved = svc.list_saved(ns)
    by_model: dict[str, list[SavedState]] = {}
    for s in saved:
        by_model.setdefault(s.model_id, []).append(s)
    known = {m.id: m for m in proto.registry.known_models(ns)}
    runs = []
    for model_id in sorted(set(loaded) | set(by_model)):
        info = loaded.get(model_id)
        mine = by_model.get(model_id, [])
        record = known.get(model_id)
        last = max([s.created for s in mine] + ([record.last_request] if record else []) or [0])
        runs.append(
            {
                "training_run_id": model_id,
                "base_model": info.base_model if info else svc.model_name,
                "model_owner": ns,
                "is_lora": True,
                "corrupted": False,
                "lora_rank": info.lora.rank if info else (record.rank if record else None),
                "last_request_time": _iso(last),
                "last_checkpoint": _latest(mine, "weights"),
                "last_sampler_checkpoint": _latest(mine, "sampler_weights"),
                "user_metadata": (record.user_metadata if record else None) or None,
            }
        )
    return runs


def _page(items: list[Any], limit: int, offset: int) -> tuple[list[Any], dict[str, int]]:
    return items[offset : offset + limit], {
        "offset": offset,
        "limit": limit,
        "total_count": len(items),
    }


def add_rest_routes(r: APIRouter, proto: Protocol, call: Callable[..., Awaitable[Any]]) -> None:
    def _run(ns: str, run_id: str) -> dict[str, Any]:
        for run in training_runs(proto, ns):
            if run["training_run_id"] == run_id:
                return run
        raise NotFoundError(f"no training run {run_id!r}", field="training_run_id")

    @r.get("/training_runs")
    async def list_runs(ns: Ns, limit: Limit = 20, offset: Offset = 0) -> dict[str, Any]:
        runs, cursor = _page(await call(training_runs, proto, ns), limit, offset)
        return {"training_runs": runs, "cursor": cursor}

    @r.get("/training_runs/{run_id}")
    async def get_run(ns: Ns, run_id: str) -> dict[str, Any]:
        return await call(_run, ns, run_id)

    @r.get("/training_runs/{run_id}/checkpoints")
    async def run_checkpoints(ns: Ns, run_id: str) -> dict[str, Any]:
        await call(_run, ns, run_id)  # 404 for a run this namespace does not have
        saved = await call(lambda: proto.training().list_saved(ns, run_id))
        return {"checkpoints": [checkpoint(s) for s in saved]}

    @r.get("/checkpoints")
    async def user_checkpoints(ns: Ns, limit: Limit = 100, offset: Offset = 0) -> dict[str, Any]:
        saved = await call(lambda: proto.training().list_saved(ns))
        page, cursor = _page([checkpoint(s) for s in saved], limit, offset)
        return {"checkpoints": page, "cursor": cursor}
