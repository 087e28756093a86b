"""The Engine's side of ``training_service.TrainingService``: a mixin whose methods hand
each call to the engine's :class:`~loraplex_engine.clients.models.ClientModels`, so that
engine.py only composes it (``Engine(ClientTraining)``, ``self.clients``)."""

from __future__ import annotations

from collections.abc import Callable

from loraplex_engine.clients.models import ClientModels
from loraplex_engine.clients.saved import Kind
from loraplex_engine.training_service import (
    AdamStep,
    ClientDatum,
    ClientLora,
    ClientModelInfo,
    ForwardOutput,
    LossCall,
    SampleCall,
    SampleOutput,
    SavedState,
)


class ClientTraining:
    """``TrainingService`` over ``self.clients`` (the Engine sets it)."""

    clients: ClientModels

    def create_model(self, namespace: str, model_id: str, lora: ClientLora) -> ClientModelInfo:
        return self.clients.create_model(namespace, model_id, lora)

    def create_model_from_state(
        self, namespace: str, model_id: str, path: str, with_optimizer: bool
    ) -> ClientModelInfo:
        return self.clients.create_model_from_state(namespace, model_id, path, with_optimizer)

    def model_info(self, namespace: str, model_id: str) -> ClientModelInfo:
        return self.clients.model_info(namespace, model_id)

    def list_models(self, namespace: str) -> list[ClientModelInfo]:
        return self.clients.list_models(namespace)

    def forward(
        self,
        namespace: str,
        model_id: str,
        data: list[ClientDatum],
        loss: LossCall,
        queued: Callable[[], None] | None = None,
    ) -> ForwardOutput:
        return self.clients.forward(namespace, model_id, data, loss, queued)

    def forward_backward(
        self,
        namespace: str,
        model_id: str,
        data: list[ClientDatum],
        loss: LossCall,
        queued: Callable[[], None] | None = None,
    ) -> ForwardOutput:
        return self.clients.forward_backward(namespace, model_id, data, loss, queued)

    def optim_step(
        self,
        namespace: str,
        model_id: str,
        adam: AdamStep,
        queued: Callable[[], None] | None = None,
    ) -> dict[str, float]:
        return self.clients.optim_step(namespace, model_id, adam, queued)

    def save_state(self, namespace: str, model_id: str, name: str, kind: Kind) -> SavedState:
        return self.clients.save_state(namespace, model_id, name, kind)

    def load_state(self, namespace: str, model_id: str, path: str, with_optimizer: bool) -> None:
        self.clients.load_state(namespace, model_id, path, with_optimizer)

    def list_saved(self, namespace: str, model_id: str | None = None) -> list[SavedState]:
        return self.clients.list_saved(namespace, model_id)

    def sample(self, namespace: str, sampler: str, call: SampleCall) -> SampleOutput:
        return self.clients.sample(namespace, sampler, call)

    def unload_model(self, namespace: str, model_id: str) -> None:
        self.clients.unload_model(namespace, model_id)
