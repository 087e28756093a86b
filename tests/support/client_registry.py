"""The client-model registry without an engine (``ClientModels(parts=None)``): models
enrolled as the Tinker door enrolls them and calls queued as ``ClientModels.submit``
queues them, for tests of the tick's take that drive the registry alone."""

from __future__ import annotations

from collections.abc import Iterable

from loraplex_engine.clients.models import ClientModels
from loraplex_engine.clients.ops import ClientModel, Op
from loraplex_engine.spec.training_service import ClientModelInfo


def enrolled(
    infos: Iterable[ClientModelInfo], limit: int | None = None
) -> tuple[ClientModels, list[ClientModel]]:
    """A registry taking at most ``limit`` models a tick, one model per info, in order."""
    registry = ClientModels(parts=None, models_per_tick=limit)
    models = []
    for info in infos:
        model = ClientModel(info, f"tinker:{info.namespace}/{info.model_id}")
        registry._enroll(model)
        models.append(model)
    return registry, models


def queue(registry: ClientModels, model: ClientModel, *ops: Op) -> None:
    with registry._queued:  # as ClientModels.submit queues a call
        for op in ops:
            model.put(op)
        registry._line.queued(model)
        registry._queued.notify_all()
