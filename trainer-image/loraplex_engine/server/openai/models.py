"""``GET /v1/models`` and ``/v1/models/{id}``: what the OpenAI routes can serve.

OpenAI's list shape (``{"object": "list", "data": [Model]}``): the base model and every
loaded experiment (its adapter as trained so far), with loraplex's metadata beside
OpenAI's fields: ``parent`` (the base model, for an adapter, as vLLM names it), ``step``,
``maxSteps`` and ``phase``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field

from loraplex_engine.server.errors import documented_errors
from loraplex_engine.spec.api_types import ExperimentStatus
from loraplex_engine.spec.errors import NotFoundError
from loraplex_engine.spec.service import EngineService

OWNER = "loraplex"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    parent: str | None = Field(description="the base model, for an experiment's adapter")
    step: int | None = Field(description="the experiment's RL step; null for the base")
    maxSteps: int | None = None
    phase: str | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


def _base_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": OWNER, "parent": None,
            "step": None}  # fmt: skip


def _experiment_card(base: str, status: ExperimentStatus) -> dict[str, Any]:
    created = int(datetime.fromisoformat(status.started_at).timestamp())
    return {
        "id": status.id,
        "object": "model",
        "created": created,
        "owned_by": OWNER,
        "parent": base,
        "step": status.step,
        "maxSteps": status.max_steps,
        "phase": status.phase,
    }


def add_models_routes(
    app: FastAPI, ready_engine: Callable[[], EngineService], route_options: dict[str, Any]
) -> None:
    @app.get(
        "/v1/models",
        response_model=ModelList,
        responses=documented_errors(401, 503),
        **route_options,
    )
    def list_models() -> dict[str, Any]:
        """The base model and every loaded experiment, as OpenAI lists models."""
        engine = ready_engine()
        base = engine.model_name
        cards = [_base_card(base)]
        cards += [_experiment_card(base, s) for s in engine.list_experiments()]
        return {"object": "list", "data": cards}

    @app.get(
        "/v1/models/{id}",
        response_model=ModelCard,
        responses=documented_errors(401, 404, 503),
        **route_options,
    )
    async def get_model(id: str) -> dict[str, Any]:
        """One model: the base, an experiment id, or a published version's name
        (``<ns>.<name>@v<N>``, ``<ns>.<name>:<alias>``: docs/versions.md)."""
        engine = await run_in_threadpool(ready_engine)
        base = engine.model_name
        if id == base:
            return _base_card(base)
        try:
            return _experiment_card(base, await run_in_threadpool(engine.get_experiment, id))
        except NotFoundError:
            if "@" not in id and ":" not in id:
                raise
        version = await run_in_threadpool(engine.describe_version, id)
        return {"id": id, "object": "model", "created": 0, "owned_by": OWNER, "parent": base,
                "step": version.step, "phase": None}  # fmt: skip
