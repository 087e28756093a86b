"""One tick: every running experiment advances one RL step, together.

Phases, in order (``api_types.TICK_PHASES``: the labels of metrics and TickReport):
plan rollouts → ``rollout`` (one mixed-adapter batch, queued completions included) →
``reward`` → ``train`` (the training strategy) → ``sync`` (rollout backend) →
``checkpoint`` (bookkeeping, periodic and final checkpoints). Each phase takes the
experiments still in play and returns who carries on; an experiment whose reward raises
or whose update goes non-finite drops out failed, alone.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from loraplex_engine.api_types import TICK_PHASES, ExperimentTick, TickReport
from loraplex_engine.errors import AdapterError, NotFoundError, RewardError, TaskError
from loraplex_engine.experiment import Experiment, now
from loraplex_engine.multi_lora import MultiLoRAModel
from loraplex_engine.rollout.backends import RolloutBackend
from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.run_store import RunStore
from loraplex_engine.tasks import Prompt
from loraplex_engine.tokens import TokenCodec
from loraplex_engine.training import ExperimentUpdate, TrainRow
from loraplex_engine.training_strategy import TrainingStrategy

_T = TypeVar("_T")


@dataclass
class CompletionJob:
    """A queued completion request, served inside the next tick's rollout batch."""

    slot_name: str | None  # experiment id, or None for the base model
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    n: int
    done: threading.Event = field(default_factory=threading.Event)
    result: list[Completion] = field(default_factory=list)
    error: Exception | None = None


@dataclass(frozen=True)
class Rollout:
    """One experiment's step: its prompts (each repeated groupSize times), their requests
    and, after the rollout phase, their completions."""

    exp: Experiment
    prompts: list[Prompt]
    requests: list[RolloutRequest]
    completions: list[Completion] = field(default_factory=list)

    @property
    def rollout_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)


@dataclass(frozen=True)
class Scored:
    rollout: Rollout
    rewards: list[float]


@dataclass(frozen=True)
class Trained:
    scored: Scored
    train_tokens: int


@dataclass(frozen=True)
class Failure:
    exp: Experiment
    reason: str  # the experiment's error text
    kind: str  # the metrics label (metrics.FAILURE_REASONS)


class Tick:
    """The phase pipeline over the engine's parts; the caller holds the model lock."""

    def __init__(
        self,
        model: MultiLoRAModel,
        codec: TokenCodec,
        backend: RolloutBackend,
        strategy: TrainingStrategy,
        store: RunStore,
    ) -> None:
        self.model = model
        self.codec = codec
        self.backend = backend
        self.strategy = strategy
        self.store = store

    def run(self, running: list[Experiment], jobs: list[CompletionJob]) -> TickReport:
        start = time.perf_counter()
        phases = dict.fromkeys(TICK_PHASES, 0.0)
        failures: list[Failure] = []

        @contextmanager
        def timed(phase: str) -> Iterator[None]:
            t = time.perf_counter()
            try:
                yield
            finally:
                phases[phase] += time.perf_counter() - t

        planned = [self._plan(e) for e in running]
        with timed("rollout"):
            rolled = self._rollout(planned, jobs)
        with timed("reward"):
            scored = _keep(self._score(rolled), failures)
        with timed("train"):
            trained = _keep(self._train(scored), failures)
        with timed("sync"):
            self.backend.sync_adapters([t.scored.rollout.exp.id for t in trained])
        with timed("checkpoint"):
            stepped = [self._after_step(t) for t in trained]
        return TickReport(
            seconds=time.perf_counter() - start,
            phase_seconds=phases,
            experiments=[_failed(f) for f in failures] + stepped,
        )

    # ---- rollout ------------------------------------------------------------------------

    def _plan(self, exp: Experiment) -> Rollout:
        alg, roll = exp.spec.algorithm, exp.spec.rollout
        slot = self.model.slot_of(exp.id)
        prompts = exp.task.sample_prompts(alg.prompts_per_step, exp.prompt_rng)
        expanded = [p for p in prompts for _ in range(alg.group_size)]
        requests = [
            RolloutRequest(
                slot=slot,
                prompt_ids=self.codec.encode_prompt(p.text, exp.spec.task.chat_template),
                max_new_tokens=roll.max_new_tokens,
                temperature=roll.temperature,
                generator=exp.sample_gen,
                group=exp.id,
                adapter=exp.id,
            )
            for p in expanded
        ]
        return Rollout(exp, expanded, requests)

    def _rollout(self, planned: list[Rollout], jobs: list[CompletionJob]) -> list[Rollout]:
        """One generate call for every experiment's requests and the queued jobs."""
        requests = [req for r in planned for req in r.requests]
        job_rows: list[tuple[CompletionJob, int]] = []
        for job in jobs:
            try:
                slot = 0 if job.slot_name is None else self.model.slot_of(job.slot_name)
            except AdapterError as e:  # its experiment left since it was queued
                job.error = NotFoundError(str(e))
                job.done.set()
                continue
            job_rows.append((job, len(requests)))
            requests += [
                RolloutRequest(
                    slot,
                    job.prompt_ids,
                    job.max_tokens,
                    job.temperature,
                    group="~job",
                    adapter=job.slot_name,
                )
                for _ in range(job.n)
            ]
        outputs = self.backend.generate(requests)
        rolled, offset = [], 0
        for r in planned:
            rolled.append(
                Rollout(r.exp, r.prompts, r.requests, outputs[offset : offset + len(r.requests)])
            )
            offset += len(r.requests)
        for job, first in job_rows:
            job.result = outputs[first : first + job.n]
            job.done.set()
        return rolled

    # ---- reward -------------------------------------------------------------------------

    def _score(self, rolled: list[Rollout]) -> list[Scored | Failure]:
        return [self._score_one(r) for r in rolled]

    def _score_one(self, r: Rollout) -> Scored | Failure:
        if any(c.nonfinite for c in r.completions):
            return Failure(r.exp, "non-finite logits from the adapter (diverged)", "non_finite")
        texts = [self.codec.decode(c.token_ids) for c in r.completions]
        try:
            rewards = r.exp.task.score(r.prompts, texts)
            bad = [x for x in rewards if not math.isfinite(x)]
            if bad:
                raise RewardError(f"reward returned a non-finite score ({bad[0]})")
        except (RewardError, TaskError, ValueError, TypeError) as e:
            return Failure(r.exp, f"reward failed: {e}", "reward_error")
        return Scored(r, rewards)

    # ---- train --------------------------------------------------------------------------

    def _train(self, scored: list[Scored]) -> list[Trained | Failure]:
        if not scored:
            return []
        rows, updates = self._train_rows(scored)
        self.model.train()
        try:
            outcomes = self.strategy.train(rows, updates)
        finally:
            self.model.eval()
        results: list[Trained | Failure] = []
        for s in scored:
            exp = s.rollout.exp
            failure = outcomes[exp.id].failure
            if failure is not None:
                results.append(Failure(exp, failure, "non_finite"))
            else:
                tokens = sum(x.length for x in rows if x.experiment == exp.id)
                results.append(Trained(s, tokens))
        return results

    def _train_rows(
        self, scored: list[Scored]
    ) -> tuple[list[TrainRow], dict[str, ExperimentUpdate]]:
        rows: list[TrainRow] = []
        updates: dict[str, ExperimentUpdate] = {}
        for s in scored:
            r, exp = s.rollout, s.rollout.exp
            alg = exp.spec.algorithm
            updates[exp.id] = ExperimentUpdate(exp.algorithm, alg.clip, alg.kl_coef)
            adv = exp.algorithm.advantages(torch.tensor(s.rewards), alg.group_size)
            slot = self.model.slot_of(exp.id)
            # Prompt group = identical prompt tokens within this experiment's step (its
            # groupSize samples, and any prompt drawn twice): they share one prefix.
            groups: dict[tuple[int, ...], int] = {}
            for req, comp, a in zip(r.requests, r.completions, adv.tolist(), strict=True):
                if comp.token_ids:
                    group = groups.setdefault(tuple(req.prompt_ids), len(groups))
                    rows.append(
                        TrainRow(
                            exp.id,
                            slot,
                            req.prompt_ids,
                            comp.token_ids,
                            comp.logprobs,
                            a,
                            req.temperature,
                            group,
                        )
                    )
        return rows, updates

    # ---- bookkeeping and checkpoints ----------------------------------------------------

    def _after_step(self, t: Trained) -> ExperimentTick:
        r, rewards = t.scored.rollout, t.scored.rewards
        exp = r.exp
        exp.step += 1
        exp.reward = sum(rewards) / len(rewards)
        exp.rollout_tokens += r.rollout_tokens
        exp.train_tokens += t.train_tokens
        exp.updated_at = now()
        finished = exp.max_steps > 0 and exp.step >= exp.max_steps
        due = exp.step % exp.spec.checkpoint.every_steps == 0
        tick = ExperimentTick(
            exp.id, exp.namespace, exp.step, exp.reward, r.rollout_tokens, t.train_tokens
        )
        if finished or due:
            self.store.save(exp)
            tick.checkpointed = True
        if finished:
            exp.phase = "Succeeded"
        return tick


def _keep(results: list[_T | Failure], failures: list[Failure]) -> list[_T]:
    """The experiments that carry on; the others are failed now and recorded."""
    kept: list[_T] = []
    for result in results:
        if isinstance(result, Failure):
            result.exp.fail(result.reason)
            failures.append(result)
        else:
            kept.append(result)
    return kept


def _failed(f: Failure) -> ExperimentTick:
    exp = f.exp
    return ExperimentTick(
        exp.id, exp.namespace, exp.step, exp.reward or 0.0, 0, 0, failed_reason=f.kind
    )
