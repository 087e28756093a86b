"""One tick: every running experiment advances one RL step, together.

Phases, in order (``api_types.TICK_PHASES``: the labels of metrics and TickReport):
plan rollouts (who is due, tick/fair_share.py; their prompts) → ``rollout`` (one
mixed-adapter batch, queued completions included; multi-turn episodes go on turn by
turn, every experiment's in one batch a turn, each at its environment's pace: a step
whose environment has not answered completes in a later tick, environments/player.py) → ``reward``
(concurrent, with a deadline: a late reward trains in a later tick) → ``train`` (the
training strategy) →
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
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch

from loraplex_engine.completion_jobs import CompletionJob, load_versions
from loraplex_engine.environments.planning import plan_group
from loraplex_engine.environments.player import EpisodePlayer
from loraplex_engine.evaluation.eval_set import eval_rows
from loraplex_engine.experiment import Experiment, now
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.rollout.backends import RolloutBackend
from loraplex_engine.rollout.base import RolloutRequest
from loraplex_engine.spec.api_types import (
    TICK_PHASES,
    AdapterSync,
    ExperimentTick,
    MemoryPlan,
    TickReport,
)
from loraplex_engine.spec.errors import (
    AdapterError,
    InvalidRequestError,
    NotFoundError,
    StorageFullError,
)
from loraplex_engine.store.run_store import RunStore
from loraplex_engine.store.spare_slots import SpareSlots
from loraplex_engine.tasks import Prompt
from loraplex_engine.tenancy.work_limits import prompt_ids
from loraplex_engine.tick.fair_share import RewardScorer, due_to_roll_out
from loraplex_engine.tick.results import (
    Failure,
    Rollout,
    Scored,
    Trained,
    eval_only_tick,
    exp_of,
    failed,
    first_error,
    guarded,
    keep,
    publish_evals,
    record_eval,
    score_one,
)
from loraplex_engine.tokens import TokenCodec
from loraplex_engine.train.algorithms import PolicyLoss
from loraplex_engine.train.experiment_rows import (
    ExperimentRows,
    Sample,
    experiment_rows,
    step_loss,
)
from loraplex_engine.train.rows import TrainRow
from loraplex_engine.train.step_stats import rollout_stats
from loraplex_engine.train.strategy import TrainingStrategy, TrainOutcome
from loraplex_engine.versions.publisher import Publisher

log = logging.getLogger("loraplex_engine.tick")


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
        publisher: Publisher | None = None,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self.model = model
        self.codec = codec
        self.backend = backend
        self.strategy = strategy
        self.store = store
        self.scorer = scorer
        self.max_prompt_tokens = max_prompt_tokens
        self.context_tokens = context_tokens
        self.publisher = publisher  # published versions (versions/publisher.py)
        # Multi-turn steps in play across ticks; ``wake``: an answer outlived its tick.
        self.episodes: EpisodePlayer[Rollout] = EpisodePlayer(scorer.deadline_s, wake)
        self.count = 0  # ticks run (fair_share.due_to_roll_out paces by it)
        # Why the last checkpoint write found the volume full (see storage_full_among).
        self.storage_full: str | None = None

    def attach_streams(self, device: torch.device, plan: MemoryPlan) -> None:
        """The pipelined tick's torch side stream (tick/pipelined.py); none here."""

    def storage_full_among(self, experiments: Iterable[Experiment]) -> str | None:
        """Why checkpoints wait for room while a running one of ``experiments`` waits."""
        waiting = any(e.checkpoint_pending and e.phase == "Running" for e in experiments)
        return self.storage_full if waiting else None

    def has_work(self, running: list[Experiment]) -> bool:
        """A tick would do something: an experiment can roll out or a reward is back."""
        arrived = self.scorer.has_arrived() or self.episodes.has_arrived()
        return arrived or any(not self.waits(e) for e in running)

    def waits(self, exp: Experiment) -> bool:
        """``exp`` may not roll out: its reward or its multi-turn step is in play."""
        return self.scorer.waits(exp) or self.episodes.waits(exp.task.environment)

    def serve(self, jobs: list[CompletionJob]) -> TickReport:
        """A serving tick: the jobs' rows in one rollout batch, no experiment's."""
        start = time.perf_counter()
        slots = self.publisher.slots if self.publisher is not None else None
        spare = slots or SpareSlots(self.model)  # versions' rows (versions/slot_cache.py)
        try:
            self._rollout([], load_versions(jobs, spare), play=False)
        finally:
            spare.release()
        seconds = time.perf_counter() - start
        phases = {**dict.fromkeys(TICK_PHASES, 0.0), "rollout": seconds}
        return TickReport(seconds, phases, kind="serve")

    def run(
        self,
        running: list[Experiment],
        jobs: Sequence[CompletionJob] = (),
        client_train: Callable[[TrainingStrategy], None] | None = None,
    ) -> TickReport:
        """A training tick: every running experiment that is due steps. ``jobs``: client
        models' samples (their training loops'); ``client_train``: the client models' steps
        (clients/ticking.py; their calls rode the experiments' update, train/riders.py),
        run in the train phase after it, with the same strategy."""
        start = time.perf_counter()
        self.count += 1
        phases = dict.fromkeys(TICK_PHASES, 0.0)
        failures: list[Failure] = []
        arrived = self.scorer.arrived(running)  # late rewards: these train now
        back = {id(exp_of(a)) for a in arrived}
        eligible = [
            e
            for e in running
            if not self.waits(e)
            and id(e) not in back
            and (not e.finished_steps or e.eval_due())  # a last eval to run
        ]
        due = due_to_roll_out(eligible, self.count)

        @contextmanager
        def timed(phase: str) -> Iterator[None]:
            t = time.perf_counter()
            try:
                yield
            finally:
                phases[phase] += time.perf_counter() - t

        plans = [guarded(e, "task_error", "task", lambda e=e: self._plan(e)) for e in due]
        planned = keep(plans, failures)
        with timed("rollout"):
            rolled = keep(self._rollout(planned, jobs), failures)
        with timed("reward"):
            scored = keep(arrived + self._score(rolled), failures)
        # Before the update: a version published on an eval holds the adapter evaluated.
        scored = keep(self._evaluated(scored), failures)
        # A co-located sampler gives the device back while the trainer uses it (the
        # train phase's seconds include vLLM's sleep and wake-up).
        with timed("train"), self.backend.training_phase() if scored else nullcontext():
            trained = keep(self._train(scored), failures)
            if client_train is not None:
                client_train(self.strategy)
        with timed("sync"):
            synced, sync = self._sync(trained)
            trained = keep(synced, failures)
        with timed("checkpoint"):
            stepped = keep([self._guarded_after_step(t) for t in trained], failures)
            stepped_ids = {id(t.scored.rollout.exp) for t in trained}
            keep(self._retry_checkpoints(running, stepped_ids), failures)
        return TickReport(
            seconds=time.perf_counter() - start,
            phase_seconds=phases,
            experiments=[failed(f) for f in failures] + stepped,
            adapter_sync=sync,
        )

    # ---- rollout ------------------------------------------------------------------------

    def _plan(self, exp: Experiment) -> Rollout:
        """The experiment's step (none once its steps are done) and the rows of its eval
        when one is due; both count in its step cost (tick/fair_share.py)."""
        alg, roll = exp.plan.algorithm, exp.plan.rollout
        slot = self.model.slot_of(exp.id)
        prompts = (
            []
            if exp.finished_steps
            else exp.task.sample_prompts(alg.prompts_per_step, exp.prompt_rng)
        )
        limits = (self.max_prompt_tokens, self.context_tokens, roll.max_new_tokens)

        def encode(p: Prompt) -> list[int]:
            chat = exp.plan.task.chat_template
            return prompt_ids(self.codec, p.text, p.position, chat, *limits)

        def request(ids: list[int], new_tokens: int = roll.max_new_tokens) -> RolloutRequest:
            return RolloutRequest(
                slot=slot,
                prompt_ids=ids,
                max_new_tokens=min(new_tokens, roll.max_new_tokens),
                temperature=roll.temperature,
                generator=exp.sample_gen,
                group=exp.id,
                adapter=exp.id,
                reproducible=roll.reproducible,
            )

        repeated = [p for p in prompts for _ in range(alg.group_size)]
        episodes = None
        if exp.task.environment is None:
            requests = [request(ids) for ids in map(encode, prompts) for _ in range(alg.group_size)]
            exp.step_cost = sum(len(r.prompt_ids) + r.max_new_tokens for r in requests)
        else:  # its first turns' requests once the environment has started its episodes
            env, bounds = exp.task.environment, limits[:2]
            episodes, exp.step_cost = plan_group(
                exp.plan.task, env, prompts, alg.group_size, encode, request, self.codec, bounds
            )
            requests = []
        evals = None
        if exp.eval_set is not None and exp.eval_due():
            rollout = (slot, roll.max_new_tokens, roll.reproducible)
            evals = eval_rows(exp.id, exp.eval_set, exp.step, alg.seed, rollout, encode)
            exp.eval_planned = exp.step
            exp.step_cost += evals.cost
        exp.rolled_out_at = self.count
        return Rollout(exp, repeated, requests, episodes=episodes, evals=evals, version=exp.step)

    def _rollout(
        self, planned: list[Rollout], jobs: Sequence[CompletionJob], play: bool = True
    ) -> list[Rollout | Failure]:
        """One generate call for every experiment's requests and the queued jobs, then the
        multi-turn steps' turns (``play``: a training tick); an experiment (or job) with a
        row the backend refused fails alone."""
        # A multi-turn step's turns are the player's (_play), its first included.
        batch = [r for r in planned if r.episodes is None]
        requests = [req for r in batch for req in r.all_requests()]
        job_rows: list[tuple[CompletionJob, int]] = []
        for job in jobs:
            try:
                slot = 0 if job.slot_name is None else self.model.slot_of(job.slot_name)
            except AdapterError as e:  # its experiment left since it was queued
                job.error = NotFoundError(str(e))
                job.done.set()
                continue
            rows = job.rows(slot)  # none: answered (cancelled, or values of its own that fail)
            if rows:
                job_rows.append((job, len(requests)))
                requests += rows
        outputs = self.backend.generate(requests)
        rolled: list[Rollout | Failure] = [r for r in planned if r.episodes is not None]
        offset = 0
        for r in batch:
            rows = len(r.all_requests())
            mine, step_rows = outputs[offset : offset + rows], len(r.requests)
            offset += rows
            error = first_error(mine)
            if error is None:
                done = {"completions": mine[:step_rows], "eval_completions": mine[step_rows:]}
                rolled.append(replace(r, **done))
            else:
                rolled.append(Failure(r.exp, f"rollout failed: {error}", "rollout_error"))
        for job, first in job_rows:
            result = outputs[first : first + job.n]
            error = first_error(result)
            if error is None:
                job.result = result
            else:
                job.error = InvalidRequestError(f"the rollout backend refused this: {error}")
            job.done.set()
        return self._play(rolled) if play else rolled

    def _play(self, rolled: list[Rollout | Failure]) -> list[Rollout | Failure]:
        """Multi-turn steps: those started now and those in play from earlier ticks go on
        (player.py); the steps that ended now join the tick, the others wait."""
        env = [r for r in rolled if isinstance(r, Rollout) and r.episodes is not None]
        started = [(r, r.episodes) for r in env if r.episodes is not None]
        ended = self.episodes.play(started, self.backend.generate, self.codec.decode)
        out = [r for r in rolled if not (isinstance(r, Rollout) and r.episodes is not None)]
        for r, g in ended:
            if r.exp.phase != "Running":  # it failed or paused while its step was in play
                continue
            if g.error:
                out.append(Failure(r.exp, g.error[0], g.error[1]))
                continue
            requests = [e.request for e in g.episodes]
            comps = [e.completion() for e in g.episodes]
            out.append(replace(r, requests=requests, completions=comps, episodes=g))
        return out

    # ---- reward -------------------------------------------------------------------------

    def _score(self, rolled: list[Rollout]) -> list[Scored | Failure]:
        """Every experiment's reward at once on the scorer's pool; those not back within
        its deadline wait for a later tick (fair_share.RewardScorer)."""
        results: list[Scored | Failure] = []
        jobs = []
        for r in rolled:
            every = r.completions + r.eval_completions
            if any(c.nonfinite for c in every):
                msg = "non-finite logits from the adapter (diverged)"
                results.append(Failure(r.exp, msg, "non_finite"))
                continue
            if r.episodes is not None:  # the environment scored them (no eval: eval_set.py)
                results.append(Scored(r, [e.reward for e in r.episodes.episodes]))
                continue
            texts = [self.codec.decode(c.token_ids) for c in every]  # tick thread
            jobs.append((r.exp, lambda r=r, texts=texts: score_one(r, texts)))
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
            if s.rollout.eval_only:  # its steps are done: nothing to train
                results.append(Trained(s, 0, TrainOutcome(), skipped=True))
                continue
            prepared = guarded(exp, "reward_error", "advantages", lambda s=s: self._rows(s))
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
            Sample(req.prompt_ids, comp.token_ids, comp.logprobs, req.temperature, comp.mask)
            for req, comp in zip(r.requests, r.completions, strict=True)
        ]
        slot = self.model.slot_of(exp.id)
        group_size = exp.plan.algorithm.group_size
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

    def _evaluated(self, scored: list[Scored]) -> list[Scored | Failure]:
        return publish_evals(None if self.publisher is None else self.publisher.after_eval, scored)

    def _guarded_after_step(self, t: Trained) -> ExperimentTick | Failure:
        exp = t.scored.rollout.exp
        return guarded(exp, "checkpoint_error", "checkpoint", lambda: self._after_step(t))

    def _after_step(self, t: Trained) -> ExperimentTick:
        r, rewards = t.scored.rollout, t.scored.rewards
        exp = r.exp
        record_eval(exp, t.scored.eval)
        if r.eval_only:  # the last adapter's eval: the experiment is done
            if _done(exp) and not exp.checkpoint_pending:
                exp.phase = "Succeeded"
            return eval_only_tick(t)
        exp.step += 1
        exp.reward = sum(rewards) / len(rewards)
        exp.rollout_tokens += r.rollout_tokens
        exp.train_tokens += t.train_tokens
        exp.logprob_gap = t.outcome.logprob_gap
        exp.tis_weight_mean = t.outcome.tis_weight_mean
        exp.skipped_updates += t.skipped
        exp.updated_at = now()
        finished = exp.finished_steps
        due = exp.step % exp.plan.checkpoint.every_steps == 0
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
            kl=t.outcome.kl,
            clip_fraction=t.outcome.clip_fraction,
            name=exp.name,
            run_id=exp.run_id,
            tracking=exp.plan.tracking,
            finished=_done(exp),
            eval=t.scored.eval,
            **rollout_stats(rewards, r.completions),
            rollout_version=r.version,
        )
        if finished or due or exp.checkpoint_pending:
            tick.checkpointed = self._save(exp)
        if self.publisher is not None:
            self.publisher.after_step(exp, exp.reward)
        if _done(exp) and not exp.checkpoint_pending:
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
            saved = guarded(exp, "checkpoint_error", "checkpoint", lambda e=exp: self._save(e))
            if isinstance(saved, Failure):
                failed.append(saved)
            elif saved and _done(exp):
                exp.phase = "Succeeded"
        return failed


def _done(exp: Experiment) -> bool:
    """Its last step is taken and, with spec.eval, its last adapter evaluated."""
    return exp.finished_steps and not exp.awaits_final_eval()
