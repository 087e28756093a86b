"""The client-model registry without an engine (``ClientModels(parts=None)``): models
enrolled as the Tinker door enrolls them and calls queued as ``ClientModels.submit``
queues them, for tests of the tick's take that drive the registry alone."""

from __future__ import annotations

from collections.abc import Iterable

from loraplex_engine.clients.models import ClientModels
from loraplex_engine.clients.ops import ClientModel, Op
from loraplex_engine.spec.training_service import ClientModelInfo


def registry_of(
    *models: ClientModel, limit: int | None = None, gather_s: float = 0.0
) -> ClientModels:
    """A registry taking at most ``limit`` models a tick, holding one up to ``gather_s``
    for calls on their way, with ``models`` enrolled in order (what they hold, queued)."""
    registry = ClientModels(parts=None, models_per_tick=limit, gather_s=gather_s)
    for model in models:
        registry._enroll(model)
    return registry


def enrolled(
    infos: Iterable[ClientModelInfo], limit: int | None = None
) -> tuple[ClientModels, list[ClientModel]]:
    """A registry taking at most ``limit`` models a tick, one model per info, in order."""
    models = [ClientModel(info, f"tinker:{info.namespace}/{info.model_id}") for info in infos]
    return registry_of(*models, limit=limit), models


def queue(registry: ClientModels, model: ClientModel, *ops: Op) -> None:
    with registry._queued:  # as ClientModels.submit queues a call
        for op in ops:
            model.put(op)
        registry._line.queued(model)
        registry._queued.notify_all()
