"""What the engine offers its drivers: the protocol the HTTP layer, the engine loop and the
local runner call, and the typed values a served completion crosses it as.

This is the boundary between HTTP and engine. The server (server/app.py, server/errors.py,
server/middleware.py, server/openai/) imports this module, the wire types
(spec/api_types.py, spec/experiment.py) and the errors, never torch or the engine's internals:
a ``PromptJob`` goes in and ``ServedRow``s come out, and the Engine turns them into its own
queued jobs and back (completion_jobs.py). tests/engine/server/test_http_boundary.py holds the line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from loraplex_engine.spec.api_types import (
    Capacity,
    CheckpointRef,
    ExperimentStatus,
    TickReport,
    VersionSummary,
)
from loraplex_engine.spec.experiment import ExperimentSpec
from loraplex_engine.spec.publish import PublishSpec

# (row, token id, log-prob, top alternatives or None); called from the tick's thread, so
# it must not block (the whole rollout batch waits on it).
TokenCallback = Callable[[int, int, float, "dict[int, float] | None"], None]


@dataclass(frozen=True)
class PromptJob:
    """One prompt's ``n`` rows, served in the next tick's rollout batch, and how to sample
    them."""

    model: str  # an experiment id (its current adapter) or the base model's name
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    n: int = 1
    top_p: float = 1.0  # nucleus sampling
    top_k: int = 0  # sample among the k most likely tokens (0 or less: all)
    top_logprobs: int = 0  # alternatives to report per sampled token (0: none)
    seed: int | None = None  # the rows share one generator seeded with it
    on_token: TokenCallback | None = None  # each sampled token as the decode makes it
    cancelled: Callable[[int], bool] | None = None  # row -> its client no longer wants it


@dataclass(frozen=True)
class ServedRow:
    """One row's answer: the sampled token ids and their log-probs (the torch backend has
    reported them through ``on_token`` already; vLLM's arrive only here)."""

    token_ids: list[int]
    logprobs: list[float]  # of each sampled token under the sampling distribution
    top_logprobs: list[dict[int, float]] | None = None  # per token: alternative -> log-prob
    finish_reason: str = "length"  # "stop": end of sequence; "cancelled": its client left


class EngineService(Protocol):
    """What the HTTP layer calls. Every method is thread-safe; the errors they raise are
    :mod:`loraplex_engine.spec.errors`' ``ApiError``\\ s (server/errors.py picks their status)."""

    @property
    def model_name(self) -> str:
        """The base model's name, as the OpenAI routes take it (cheap: no capacity)."""

    @property
    def context_tokens(self) -> int | None:
        """The base model's context window, when it states one."""

    def is_ready(self) -> bool: ...

    def put_experiment(
        self,
        exp_id: str,
        spec: ExperimentSpec,
        namespace: str,
        name: str,
        resume_from: str | None,
        run_id: str | None = None,
    ) -> tuple[ExperimentStatus, bool]:
        """Start or resume; returns (status, created). Same spec again is a no-op.

        ``run_id`` names the run (its checkpoint directory): with it and no
        ``resume_from``, the run's newest intact checkpoint is resumed if it has one."""

    def get_experiment(self, exp_id: str) -> ExperimentStatus: ...

    def list_experiments(self) -> list[ExperimentStatus]: ...

    def checkpoint_experiment(self, exp_id: str) -> CheckpointRef: ...

    def publish_version(self, exp_id: str) -> VersionSummary: ...

    def update_publish(self, exp_id: str, publish: PublishSpec | None) -> ExperimentStatus: ...

    def describe_version(self, model: str) -> VersionSummary: ...

    def remove_experiment(self, exp_id: str) -> ExperimentStatus:
        """Checkpoint, then unload and free the slot."""

    def capacity(self) -> Capacity:
        """Slots, memory and the memory plan: /v1/capacity and the metrics, nothing else."""

    def complete(self, job: PromptJob) -> list[ServedRow]:
        """``job.n`` rows from an experiment's current adapter (or the base), served in
        the next tick's rollout batch. Blocks until done."""

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids (ids outside the vocabulary: InvalidRequestError)."""

    def detokenize(self, token_ids: list[int]) -> str: ...

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The messages through the chat template (none: InvalidRequestError)."""


class TickingEngine(EngineService, Protocol):
    """The service plus the tick that drives it: what the engine loop (server/serve.py)
    and the local runner (local/runner.py) call."""

    def tick(self) -> TickReport | None:
        """Advance every running experiment one step; None when nothing ran."""
