"""The engine while it loads: the HTTP app starts first (``/healthz`` answers at once) and
serves through this stand-in, which answers 503 until ``engine`` is set
(server/serve.py sets it once the model and backend have loaded)."""

from __future__ import annotations

from typing import Any

from loraplex_engine.spec.api_types import (
    Capacity,
    CheckpointRef,
    ExperimentStatus,
    TickReport,
    VersionSummary,
)
from loraplex_engine.spec.errors import UnavailableError
from loraplex_engine.spec.service import PromptJob, ServedRow, TickingEngine


class EngineHolder:
    """Stands in for the engine until it has loaded, so the HTTP app can start first.

    Before loading finishes every call raises :class:`UnavailableError` (503)."""

    def __init__(self, model_name: str, rollout_backend: str) -> None:
        self.model_name = model_name
        self.rollout_backend = rollout_backend
        self.engine: TickingEngine | None = None

    @property
    def tokenizer(self) -> Any:
        return getattr(self.engine, "tokenizer", None)

    @property
    def context_tokens(self) -> int | None:
        return self._get().context_tokens

    @property
    def queued_completions(self) -> int:
        return getattr(self.engine, "queued_completions", 0)

    def _get(self) -> TickingEngine:
        engine = self.engine
        if engine is None:
            raise UnavailableError("the engine is still loading")
        return engine

    def is_ready(self) -> bool:
        return self.engine is not None and self.engine.is_ready()

    def put_experiment(
        self,
        exp_id: str,
        spec: Any,
        namespace: str,
        name: str,
        resume_from: str | None,
        run_id: str | None = None,
    ) -> tuple[ExperimentStatus, bool]:
        return self._get().put_experiment(exp_id, spec, namespace, name, resume_from, run_id)

    def get_experiment(self, exp_id: str) -> ExperimentStatus:
        return self._get().get_experiment(exp_id)

    def list_experiments(self) -> list[ExperimentStatus]:
        return self._get().list_experiments()

    def checkpoint_experiment(self, exp_id: str) -> CheckpointRef:
        return self._get().checkpoint_experiment(exp_id)

    def remove_experiment(self, exp_id: str) -> ExperimentStatus:
        return self._get().remove_experiment(exp_id)

    def publish_version(self, exp_id: str) -> VersionSummary:
        return self._get().publish_version(exp_id)

    def update_publish(self, exp_id: str, publish: Any) -> ExperimentStatus:
        return self._get().update_publish(exp_id, publish)

    def describe_version(self, model: str) -> VersionSummary:
        return self._get().describe_version(model)

    def capacity(self) -> Capacity:
        return self._get().capacity()

    def complete(self, job: PromptJob) -> list[ServedRow]:
        return self._get().complete(job)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self._get().tokenize(prompt)

    def detokenize(self, token_ids: list[int]) -> str:
        return self._get().detokenize(token_ids)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self._get().chat_prompt(messages)

    def tick(self) -> TickReport | None:
        return self._get().tick()
