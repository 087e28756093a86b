"""One tick: every running experiment advances one RL step, together.

Phases, in order (``api_types.TICK_PHASES``: the labels of metrics and TickReport):
plan rollouts (who is due, tenancy/fair_share.py; their prompts) → ``rollout`` (one
mixed-adapter batch, queued completions included) → ``reward`` (concurrent, with a
deadline: a late reward trains in a later tick) → ``train`` (the training strategy) →
``sync`` (rollout backend) → ``checkpoint`` (bookkeeping, periodic and final
checkpoints). Each phase takes the experiments still in play and returns who carries on.

Containment: every per-experiment step (prompts and task data, reward, training rows,
checkpoint) runs under a guard that fails that experiment alone, with its error and a
``failureReason`` in its status; whatever its tenant's data or reward service does, the
tick goes on. The rollout backend reports a row it refused or failed (``Completion.error``)
and an adapter it could not sync per experiment: ``rollout_error``, that experiment alone.
Only the shared steps (a rollout batch the backend gives up on, the fused update) can fail
a tick: those are faults of the base model or the device.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TypeVar

from loraplex_engine.api_types import TICK_PHASES, AdapterSync, ExperimentTick, TickReport
from loraplex_engine.completion_jobs import CompletionJob
from loraplex_engine.errors import (
    AdapterError,
    InvalidRequestError,
    NotFoundError,
    RewardError,
    StorageFullError,
    TaskError,
)
from loraplex_engine.experiment import Experiment, now
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.rollout.backends import RolloutBackend
from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.store.run_store import RunStore
from loraplex_engine.tasks import Prompt
from loraplex_engine.tenancy.fair_share import RewardScorer, due_to_roll_out
from loraplex_engine.tenancy.work_limits import prompt_ids
from loraplex_engine.tokens import TokenCodec
from loraplex_engine.train.algorithms import PolicyLoss
from loraplex_engine.train.experiment_rows import (
    ExperimentRows,
    Sample,
    experiment_rows,
    step_loss,
)
from loraplex_engine.train.rows import TrainRow
from loraplex_engine.train.strategy import TrainingStrategy, TrainOutcome

_T = TypeVar("_T")
log = logging.getLogger("loraplex_engine.tick")


@dataclass(frozen=True)
class Rollout:
    """One experiment's step: its prompts (each repeated groupSize times), their requests
    and, after the rollout phase, their completions."""

    exp: Experiment
    prompts: list[Prompt]
    requests: list[RolloutRequest]
    completions: list[Completion] = field(default_factory=list)
    version: int = 0  # the adapter's step (its weights' version) when this was planned

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
    outcome: TrainOutcome  # its statistics (the gap, TIS), finite or None
    dropped_groups: int = 0  # groups the dynamic-sampling filter left out
    skipped: bool = False  # no row trained (every group dropped): no update


@dataclass(frozen=True)
class Failure:
    exp: Experiment
    reason: str  # the experiment's error text
    kind: str  # status.failureReason and the metrics label (api_types.FAILURE_REASONS)


def _guarded(exp: Experiment, kind: str, what: str, step: Callable[[], _T]) -> _T | Failure:
    """Run one experiment's own step; any error in it fails that experiment alone.

    Broad on purpose: this is the boundary between a tenant's spec, data and reward
    service and the shared tick, and no tenant input may stop the engine."""
    try:
        return step()
    except Exception as e:
        if not isinstance(e, RewardError | TaskError | ValueError):
            log.warning("experiment %s: %s failed", exp.id, what, exc_info=True)
        return Failure(exp, f"{what} failed: {_describe(e)}", kind)


def _describe(e: Exception) -> str:
    """One line: the error's message, with its class when that is not one of ours."""
    text = " ".join(str(e).split())[:500] or "(no message)"
    if isinstance(e, RewardError | TaskError):
        return text
    return f"{type(e).__name__}: {text}"


class Tick:
    """The phase pipeline over the engine's parts; the caller holds the model lock."""

    def __init__(
        self,
        model: MultiLoRAModel,
        codec: TokenCodec,
        backend: RolloutBackend,
        strategy: TrainingStrategy,
        store: RunStore,
        scorer: RewardScorer[Scored | Failure],
        max_prompt_tokens: int,
        context_tokens: int | None,
    ) -> None:
        self.model = model
        self.codec = codec
        self.backend = backend
        self.strategy = strategy
        self.store = store
        self.scorer = scorer
        self.max_prompt_tokens = max_prompt_tokens
        self.context_tokens = context_tokens
        self.count = 0  # ticks run (fair_share.due_to_roll_out paces by it)
        # Why the last checkpoint write found the volume full (see storage_full_among).
        self.storage_full: str | None = None

    def storage_full_among(self, experiments: Iterable[Experiment]) -> str | None:
        """Why checkpoints wait for room while a running one of ``experiments`` waits."""
        waiting = any(e.checkpoint_pending and e.phase == "Running" for e in experiments)
        return self.storage_full if waiting else None

    def has_work(self, running: list[Experiment]) -> bool:
        """A tick would do something: an experiment can roll out or a reward is back."""
        return self.scorer.has_arrived() or any(not self.scorer.waits(e) for e in running)

    def serve(self, jobs: list[CompletionJob]) -> TickReport:
        """A serving tick: the jobs' rows in one rollout batch, no experiment's."""
        start = time.perf_counter()
        self._rollout([], jobs)
        seconds = time.perf_counter() - start
        return TickReport(seconds, {**dict.fromkeys(TICK_PHASES, 0.0), "rollout": seconds})

    def run(
        self,
        running: list[Experiment],
        jobs: Sequence[CompletionJob] = (),
        client_train: Callable[[TrainingStrategy], None] | None = None,
    ) -> TickReport:
        """A training tick: every running experiment that is due steps. ``jobs``: client
        models' samples (their training loops'); ``client_train``: the client models' pass
        (clients/ticking.py), run in the train phase after the experiments' update, with
        the same strategy."""
        start = time.perf_counter()
        self.count += 1
        phases = dict.fromkeys(TICK_PHASES, 0.0)
        failures: list[Failure] = []
        arrived = self.scorer.arrived(running)  # late rewards: these train now
        back = {id(_exp_of(a)) for a in arrived}
        eligible = [
            e
            for e in running
            if not self.scorer.waits(e) and id(e) not in back and not _finished(e)
        ]
        due = due_to_roll_out(eligible, self.count)

        @contextmanager
        def timed(phase: str) -> Iterator[None]:
            t = time.perf_counter()
            try:
                yield
            finally:
                phases[phase] += time.perf_counter() - t

        plans = [_guarded(e, "task_error", "task", lambda e=e: self._plan(e)) for e in due]
        planned = _keep(plans, failures)
        with timed("rollout"):
            rolled = _keep(self._rollout(planned, jobs), failures)
        with timed("reward"):
            scored = _keep(arrived + self._score(rolled), failures)
        # A co-located sampler gives the device back while the trainer uses it (the
        # train phase's seconds include vLLM's sleep and wake-up).
        with timed("train"), self.backend.training_phase() if scored else nullcontext():
            trained = _keep(self._train(scored), failures)
            if client_train is not None:
                client_train(self.strategy)
        with timed("sync"):
            synced, sync = self._sync(trained)
            trained = _keep(synced, failures)
        with timed("checkpoint"):
            stepped = _keep([self._guarded_after_step(t) for t in trained], failures)
            stepped_ids = {id(t.scored.rollout.exp) for t in trained}
            _keep(self._retry_checkpoints(running, stepped_ids), failures)
        return TickReport(
            seconds=time.perf_counter() - start,
            phase_seconds=phases,
            experiments=[_failed(f) for f in failures] + stepped,
            adapter_sync=sync,
        )

    # ---- rollout ------------------------------------------------------------------------

    def _plan(self, exp: Experiment) -> Rollout:
        alg, roll = exp.spec.algorithm, exp.spec.rollout
        slot = self.model.slot_of(exp.id)
        prompts = exp.task.sample_prompts(alg.prompts_per_step, exp.prompt_rng)
        limits = (self.max_prompt_tokens, self.context_tokens, roll.max_new_tokens)
        encoded = [
            prompt_ids(self.codec, p.text, p.meta.get("line"), exp.spec.task.chat_template, *limits)
            for p in prompts
        ]
        requests = [
            RolloutRequest(
                slot=slot,
                prompt_ids=ids,
                max_new_tokens=roll.max_new_tokens,
                temperature=roll.temperature,
                generator=exp.sample_gen,
                group=exp.id,
                adapter=exp.id,
                reproducible=roll.reproducible,
            )
            for ids in encoded
            for _ in range(alg.group_size)
        ]
        exp.step_cost = sum(len(r.prompt_ids) + r.max_new_tokens for r in requests)
        exp.rolled_out_at = self.count
        prompts = [p for p in prompts for _ in range(alg.group_size)]
        return Rollout(exp, prompts, requests, version=exp.step)

    def _rollout(
        self, planned: list[Rollout], jobs: Sequence[CompletionJob]
    ) -> list[Rollout | Failure]:
        """One generate call for every experiment's requests and the queued jobs; an
        experiment (or job) with a row the backend refused fails alone."""
        requests = [req for r in planned for req in r.requests]
        job_rows: list[tuple[CompletionJob, int]] = []
        for job in jobs:
            try:
                slot = 0 if job.slot_name is None else self.model.slot_of(job.slot_name)
            except AdapterError as e:  # its experiment left since it was queued
                job.error = NotFoundError(str(e))
                job.done.set()
                continue
            if job.abandoned():
                job.done.set()
                continue
            job_rows.append((job, len(requests)))
            requests += job.requests(slot)
        outputs = self.backend.generate(requests)
        rolled: list[Rollout | Failure] = []
        offset = 0
        for r in planned:
            mine = outputs[offset : offset + len(r.requests)]
            offset += len(r.requests)
            error = _first_error(mine)
            if error is None:
                rolled.append(Rollout(r.exp, r.prompts, r.requests, mine, r.version))
            else:
                rolled.append(Failure(r.exp, f"rollout failed: {error}", "rollout_error"))
        for job, first in job_rows:
            result = outputs[first : first + job.n]
            error = _first_error(result)
            if error is None:
                job.result = result
            else:
                job.error = InvalidRequestError(f"the rollout backend refused this: {error}")
            job.done.set()
        return rolled

    # ---- reward -------------------------------------------------------------------------

    def _score(self, rolled: list[Rollout]) -> list[Scored | Failure]:
        """Every experiment's reward at once on the scorer's pool; those not back within
        its deadline wait for a later tick (fair_share.RewardScorer)."""
        results: list[Scored | Failure] = []
        jobs = []
        for r in rolled:
            if any(c.nonfinite for c in r.completions):
                msg = "non-finite logits from the adapter (diverged)"
                results.append(Failure(r.exp, msg, "non_finite"))
                continue
            texts = [self.codec.decode(c.token_ids) for c in r.completions]  # tick thread
            jobs.append((r.exp, lambda r=r, texts=texts: _score_one(r, texts)))
        return results + self.scorer.score(jobs)

    # ---- train --------------------------------------------------------------------------

    def _train(self, scored: list[Scored]) -> list[Trained | Failure]:
        """Each experiment's rows (its advantages) on its own, then one shared update; an
        experiment with no row left (dynamic sampling dropped every group) skips it."""
        results: list[Trained | Failure] = []
        kept: list[tuple[Scored, ExperimentRows]] = []
        rows: list[TrainRow] = []
        losses: dict[str, PolicyLoss] = {}
        for s in scored:
            exp = s.rollout.exp
            prepared = _guarded(exp, "reward_error", "advantages", lambda s=s: self._rows(s))
            if isinstance(prepared, Failure):
                results.append(prepared)
            elif prepared.skipped:
                results.append(Trained(s, 0, TrainOutcome(), prepared.step.dropped_groups, True))
            else:
                rows += prepared.rows
                losses[exp.id] = step_loss(exp.algorithm, prepared.rows)
                kept.append((s, prepared))
        if not kept:
            return results
        self.model.train()
        try:
            outcomes = self.strategy.train(rows, losses)
        finally:
            self.model.eval()
        for s, prepared in kept:
            exp = s.rollout.exp
            outcome = outcomes[exp.id]
            if outcome.failure is not None:
                results.append(Failure(exp, outcome.failure, "non_finite"))
            else:
                tokens = sum(x.length for x in prepared.rows)
                dropped = prepared.step.dropped_groups
                results.append(Trained(s, tokens, outcome.finite(), dropped))
        return results

    def _rows(self, s: Scored) -> ExperimentRows:
        """One experiment's training rows, with their group-relative advantages."""
        r, exp = s.rollout, s.rollout.exp
        samples = [
            Sample(req.prompt_ids, comp.token_ids, comp.logprobs, req.temperature)
            for req, comp in zip(r.requests, r.completions, strict=True)
        ]
        slot = self.model.slot_of(exp.id)
        group_size = exp.spec.algorithm.group_size
        return experiment_rows(exp.id, slot, exp.algorithm, group_size, samples, s.rewards)

    # ---- sync ---------------------------------------------------------------------------

    def _sync(self, trained: list[Trained]) -> tuple[list[Trained | Failure], AdapterSync | None]:
        """The backend takes the new weights of the adapters trained now (no other
        changed); an adapter it refuses fails its experiment (its rollouts would come
        from stale weights). Also returns the sync's measure (None: nothing crossed)."""
        changed = [t.scored.rollout.exp.id for t in trained if not t.skipped]
        result = self.backend.sync_adapters(changed)
        out: list[Trained | Failure] = []
        for t in trained:
            exp = t.scored.rollout.exp
            why = result.refused.get(exp.id)
            if why is None:
                out.append(t)
            else:
                out.append(Failure(exp, f"adapter sync failed: {why}", "rollout_error"))
        return out, result.sync

    # ---- bookkeeping and checkpoints ----------------------------------------------------

    def _guarded_after_step(self, t: Trained) -> ExperimentTick | Failure:
        exp = t.scored.rollout.exp
        return _guarded(exp, "checkpoint_error", "checkpoint", lambda: self._after_step(t))

    def _after_step(self, t: Trained) -> ExperimentTick:
        r, rewards = t.scored.rollout, t.scored.rewards
        exp = r.exp
        exp.step += 1
        exp.reward = sum(rewards) / len(rewards)
        exp.rollout_tokens += r.rollout_tokens
        exp.train_tokens += t.train_tokens
        exp.logprob_gap = t.outcome.logprob_gap
        exp.tis_weight_mean = t.outcome.tis_weight_mean
        exp.skipped_updates += t.skipped
        exp.updated_at = now()
        finished = exp.max_steps > 0 and exp.step >= exp.max_steps
        due = exp.step % exp.spec.checkpoint.every_steps == 0
        tick = ExperimentTick(
            exp.id,
            exp.namespace,
            exp.step,
            exp.reward,
            r.rollout_tokens,
            t.train_tokens,
            logprob_gap=t.outcome.logprob_gap,
            tis_weight_mean=t.outcome.tis_weight_mean,
            tis_tokens=t.outcome.tis_tokens,
            dropped_groups=t.dropped_groups,
            update_skipped=t.skipped,
            rollout_version=r.version,
        )
        if finished or due or exp.checkpoint_pending:
            tick.checkpointed = self._save(exp)
        if finished and not exp.checkpoint_pending:
            exp.phase = "Succeeded"
        return tick

    def _save(self, exp: Experiment) -> bool:
        """Checkpoint ``exp``; a full volume (not this tenant's doing: its quota is checked
        first) leaves it training and the write pending, retried every tick."""
        try:
            self.store.save(exp)
        except StorageFullError as e:
            log.warning("experiment %s: checkpoint deferred: %s", exp.id, e)
            exp.checkpoint_pending, self.storage_full = True, str(e)
            return False
        exp.checkpoint_pending = False  # storage_full stays while another one waits
        return True

    def _retry_checkpoints(self, running: list[Experiment], stepped: set[int]) -> list[Failure]:
        """Pending checkpoints of experiments that did not step this tick (a finished one
        waits here for room to write its last); the experiments whose retry failed."""
        failed: list[Failure] = []
        for exp in running:
            if not exp.checkpoint_pending or id(exp) in stepped:
                continue
            saved = _guarded(exp, "checkpoint_error", "checkpoint", lambda e=exp: self._save(e))
            if isinstance(saved, Failure):
                failed.append(saved)
            elif saved and _finished(exp):
                exp.phase = "Succeeded"
        return failed


def _finished(exp: Experiment) -> bool:
    return exp.max_steps > 0 and exp.step >= exp.max_steps


def _score_one(r: Rollout, texts: list[str]) -> Scored | Failure:
    """One experiment's reward (on a pool thread)."""

    def score() -> Scored:
        rewards = [float(x) for x in r.exp.task.score(r.prompts, texts)]
        bad = [x for x in rewards if not math.isfinite(x)]
        if bad:
            raise RewardError(f"reward returned a non-finite score ({bad[0]})")
        return Scored(r, rewards)

    return _guarded(r.exp, "reward_error", "reward", score)


def _first_error(completions: list[Completion]) -> str | None:
    return next((c.error for c in completions if c.error is not None), None)


def _exp_of(item: Scored | Failure) -> Experiment:
    return item.rollout.exp if isinstance(item, Scored) else item.exp


def _keep(results: list[_T | Failure], failures: list[Failure]) -> list[_T]:
    """The experiments that carry on; the others are failed now and recorded."""
    kept: list[_T] = []
    for result in results:
        if isinstance(result, Failure):
            result.exp.fail(result.reason, result.kind)
            failures.append(result)
        else:
            kept.append(result)
    return kept


def _failed(f: Failure) -> ExperimentTick:
    exp = f.exp
    return ExperimentTick(
        exp.id, exp.namespace, exp.step, exp.reward or 0.0, 0, 0, failed_reason=f.kind
    )
