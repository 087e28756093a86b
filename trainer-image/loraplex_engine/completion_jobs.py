"""Served completions on the engine's side of the service (spec/service.py): a ``PromptJob``
becomes a queued :class:`CompletionJob`, whose rows ride in the next tick's rollout batch
(tick/tick.py), and its rollout ``Completion``\\ s go back as ``ServedRow``\\ s.

Here, not in the HTTP layer, because this is where torch (the seed's generator) and the
rollout's types live: the server only ever sees the service's values.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.spec.errors import (
    ApiError,
    CheckpointError,
    InvalidRequestError,
    UnavailableError,
)
from loraplex_engine.spec.service import PromptJob, ServedRow, TokenCallback
from loraplex_engine.store.spare_slots import SpareSlots
from loraplex_engine.versions.slot_cache import VersionSlots

log = logging.getLogger("loraplex_engine.completion_jobs")


@dataclass
class CompletionJob:
    """A queued completion request, served inside the next tick's rollout batch."""

    job: PromptJob
    slot_name: str | None  # experiment id, or None for the base model
    generator: torch.Generator | None = None  # from the job's seed; its rows share it
    # Dropped (None) once its listener fails: one gone client never fails a tick.
    on_token: TokenCallback | None = None
    done: threading.Event = field(default_factory=threading.Event)
    result: list[Completion] = field(default_factory=list)
    error: Exception | None = None

    # A published version's directory, loaded into a spare slot named slot_name for the
    # serving tick (versions/publisher.py); None: a live adapter or the base.
    version_dir: Path | None = None

    @classmethod
    def of(
        cls, job: PromptJob, base_model: str, version: tuple[str, Path] | None = None
    ) -> CompletionJob:
        """``version``: the adapter name and directory a version name serves from."""
        generator = None if job.seed is None else torch.Generator().manual_seed(job.seed)
        slot_name = None if job.model == base_model else job.model
        if version is not None:
            return cls(job, version[0], generator, job.on_token, version_dir=version[1])
        return cls(job, slot_name, generator, job.on_token)

    @property
    def n(self) -> int:
        return self.job.n

    def model_of(self) -> str:
        return self.job.model

    def cost(self) -> int:
        """Tokens it may hold in a rollout, as a step's cost counts them (tenancy/)."""
        return self.job.n * (len(self.job.prompt_ids) + self.job.max_tokens)

    def requests(self, slot: int) -> list[RolloutRequest]:
        """Its ``n`` rows; they share the job's seeded generator, if it has one."""
        job = self.job
        return [
            RolloutRequest(
                slot,
                job.prompt_ids,
                job.max_tokens,
                job.temperature,
                generator=self.generator,
                group="~job",
                adapter=self.slot_name,
                top_p=job.top_p,
                top_k=job.top_k,
                top_logprobs=job.top_logprobs,
                seeded=self.generator is not None,
                sink=None if self.on_token is None else _JobRowSink(self, row),
            )
            for row in range(job.n)
        ]

    def rows(self, slot: int) -> list[RolloutRequest]:
        """:meth:`requests`, for the tick's batch; none, and the job answered, when every
        row is cancelled or a value of its own cannot go into the batch's tensors (the
        job fails alone, never the tick its co-tenants share)."""
        if self.abandoned():
            self.done.set()
            return []
        try:
            check_tensors(self.job)
        except InvalidRequestError as e:
            self.error = e
            self.done.set()
            return []
        return self.requests(slot)

    def abandoned(self) -> bool:
        """Every row cancelled before the batch: the job is answered without decoding."""
        cancelled = self.job.cancelled
        return cancelled is not None and all(cancelled(row) for row in range(self.n))

    def answer(self) -> list[ServedRow]:
        """The rows as the service returns them; the job's error, raised, if it failed."""
        if self.error is not None:
            raise self.error
        return [
            ServedRow(c.token_ids, c.logprobs, c.top_logprobs, c.finish_reason) for c in self.result
        ]


def check_tensors(job: PromptJob) -> None:
    """The values the job's rows put in the rollout's batched tensors (token ids and
    counts as int64, temperature and top_p as float32), built for this job alone first:
    one that overflows or is not finite raises ``InvalidRequestError`` here, for this job,
    instead of failing the whole batch where the rollout builds them together."""
    counts = [job.max_tokens, job.top_logprobs, job.n, *job.prompt_ids]
    try:
        torch.tensor([job.top_k, *counts], dtype=torch.long)
        floats = torch.tensor([job.temperature, job.top_p], dtype=torch.float32)
    except (OverflowError, RuntimeError, TypeError, ValueError) as e:
        raise InvalidRequestError(f"a sampling value the rollout cannot take: {e}") from None
    if not bool(torch.isfinite(floats).all()) or job.temperature < 0 or not 0 < job.top_p <= 1:
        raise InvalidRequestError("temperature and top_p must be finite, >= 0 and in (0, 1]")
    if min(counts) < 0:  # top_k alone may be negative (no cut)
        raise InvalidRequestError("token ids and counts must not be negative")


def load_versions(
    jobs: list[CompletionJob], spare: SpareSlots | VersionSlots
) -> list[CompletionJob]:
    """Load the published versions ``jobs`` ask for into spare slots; a job whose version
    cannot be loaded (no free slot, a broken directory) is answered with why. Returns the
    jobs left to serve."""
    ready = []
    for job in jobs:
        if job.version_dir is not None and job.slot_name is not None:
            try:
                spare.load(job.slot_name, job.version_dir, job.slot_name)
            except (ApiError, CheckpointError) as e:
                job.error = e if isinstance(e, ApiError) else UnavailableError(str(e))
                job.done.set()
                continue
        ready.append(job)
    return ready


def resolve(jobs: list[CompletionJob], error: Exception) -> None:
    """Answer every job not answered yet with ``error``."""
    for job in jobs:
        if not job.done.is_set():
            job.error = error
            job.done.set()


@dataclass
class _JobRowSink:
    job: CompletionJob
    row: int

    def push(self, token_id: int, logprob: float, top: dict[int, float] | None) -> None:
        if self.job.on_token is None:
            return
        try:
            self.job.on_token(self.row, token_id, logprob, top)
        except Exception:  # a listener gone (its event loop closed) never fails the tick
            log.exception("dropping a served row's token report")
            self.job.on_token = None

    def cancelled(self) -> bool:
        check = self.job.job.cancelled
        return check is not None and check(self.row)
