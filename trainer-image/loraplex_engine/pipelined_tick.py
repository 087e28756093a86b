"""The pipelined schedule (``--schedule pipelined``; docs/design/pipeline.md).

The sync tick (tick.py) rolls out every due experiment, scores, trains and syncs them,
in that order: while it trains nothing generates. Here a tick trains the experiments
whose rollouts are already scored (the previous tick's) while the rollouts of the others
generate and score, on a thread: with vLLM in its own process the two use different
cores (or devices). Per experiment the stages stay in order (generate → score → train →
sync), so with ``algorithm.maxStaleness`` 0 an experiment never generates in the tick
that trains it, and samples with the weights of its own last update: on-policy, as in the
sync tick. With maxStaleness > 0 it may generate in that tick too, from the weights
before the update: one step stale, corrected by the PPO ratio against the sampler's
log-probs (torch rollout) or TIS (vLLM, ``offPolicyCorrection: tis``). Every trained
step reports the version its rollout was sampled with (``ExperimentTick.rollout_version``).

Every backend call finishes inside the tick (the rollout thread is joined before the
trained adapters sync), so adding and removing experiments between ticks is as safe as
under the sync tick. A rollout that shares the trainer's weights (torch) cannot overlap
the update without reading half-updated weights: there the stages run one after the
other, rollout first (a stale rollout then samples the pre-update weights, as recorded).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

from loraplex_engine.api_types import TICK_PHASES, TickReport
from loraplex_engine.completion_jobs import CompletionJob
from loraplex_engine.errors import UsageError
from loraplex_engine.experiment import Experiment
from loraplex_engine.parallel.distributed import World
from loraplex_engine.settings.engine import SCHEDULES
from loraplex_engine.tenancy.fair_share import due_to_roll_out
from loraplex_engine.tick import Tick
from loraplex_engine.tick_results import Failure, Rollout, Scored, Trained, failed, guarded, keep
from loraplex_engine.train.strategy import TrainingStrategy


def tick_class(schedule: str, world: World | None = None) -> type[Tick]:
    """The tick of ``schedule``: the sync one, or this pipelined one."""
    if schedule not in SCHEDULES:
        raise UsageError(f"schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")
    if schedule == "pipelined" and world is not None:
        raise UsageError("--schedule pipelined runs on one rank; data parallelism needs sync")
    return PipelinedTick if schedule == "pipelined" else Tick


def max_staleness(exp: Experiment) -> int:
    return exp.spec.algorithm.max_staleness


def may_roll_out(exp: Experiment, training: bool) -> bool:
    """``exp`` may start a rollout this tick: not while its own update is being made
    unless it allows a stale one, and never past its last step (but for the eval of its
    last adapter, spec.eval)."""
    if exp.finished_steps:
        return not training and exp.eval_due()
    if not training:
        return True
    last = exp.max_steps > 0 and exp.step + 1 >= exp.max_steps
    return max_staleness(exp) > 0 and not last


def _owner(item: Trained | Failure) -> Experiment:
    return item.exp if isinstance(item, Failure) else item.scored.rollout.exp


def fill_split(due: list[Experiment]) -> list[Experiment]:
    """Who rolls out when nothing trains (the first tick, or after a pause): half of the
    on-policy experiments, so that from the next tick on one half trains while the other
    generates. Experiments allowing staleness overlap with themselves and all go."""
    strict = [e for e in due if max_staleness(e) == 0]
    if len(strict) < 2:
        return due
    first = {id(e) for e in strict[: (len(strict) + 1) // 2]}
    return [e for e in due if max_staleness(e) > 0 or id(e) in first]


class PipelinedTick(Tick):
    """Trains last tick's scored rollouts while this tick's generate (module doc)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        # Scored rollouts waiting for their update: at most one per experiment.
        self.ready: dict[str, Scored] = {}

    def has_work(self, running: list[Experiment]) -> bool:
        return bool(self.ready) or super().has_work(running)

    def run(
        self,
        running: list[Experiment],
        jobs: Sequence[CompletionJob] = (),
        client_train: Callable[[TrainingStrategy], None] | None = None,
    ) -> TickReport:
        """One stage of every experiment in play: those with a scored rollout train,
        the ones allowed to roll out (:func:`may_roll_out`, then the fair share) generate
        and score, at once where the backend allows. Phase seconds overlap."""
        start = time.perf_counter()
        self.count += 1
        phases = dict.fromkeys(TICK_PHASES, 0.0)
        failures: list[Failure] = []
        to_train = self._take_ready(running) + keep(self.scorer.arrived(running), failures)
        training = {id(s.rollout.exp) for s in to_train}
        eligible = [
            e for e in running if not self.scorer.waits(e) and may_roll_out(e, id(e) in training)
        ]
        due = due_to_roll_out(eligible, self.count)
        if not to_train:
            due = fill_split(due)
        plans = [guarded(e, "task_error", "task", lambda e=e: self._plan(e)) for e in due]
        planned = keep(plans, failures)
        scored, trained = self._overlap(planned, jobs, to_train, client_train, phases)
        for s in keep(scored, failures):
            self.ready[s.rollout.exp.id] = s
        # A stale experiment can fail in its next rollout (its task, reward) while its
        # update is made: failed, it does not step (its last checkpoint stands).
        lost = {id(f.exp) for f in failures}
        trained = keep([t for t in trained if id(_owner(t)) not in lost], failures)
        t = time.perf_counter()
        synced, sync = self._sync(trained)
        trained = keep(synced, failures)
        phases["sync"] += time.perf_counter() - t
        t = time.perf_counter()
        # An eval scored while its own update was made (maxStaleness > 0) scored the
        # adapter one step back: its scores join the step's version as the latest before.
        evaluated = [s for s in self.ready.values() if s.eval is not None]
        for s in evaluated if self.publisher is not None else ():
            if id(s.rollout.exp) in training:
                s.rollout.exp.published.last_eval = s.eval
        stepped = keep([self._guarded_after_step(x) for x in trained], failures)
        keep(self._evaluated(evaluated), failures)
        stepped_ids = {id(x.scored.rollout.exp) for x in trained}
        keep(self._retry_checkpoints(running, stepped_ids), failures)
        phases["checkpoint"] += time.perf_counter() - t
        return TickReport(
            seconds=time.perf_counter() - start,
            phase_seconds=phases,
            experiments=[failed(f) for f in failures] + stepped,
            adapter_sync=sync,
        )

    def _take_ready(self, running: list[Experiment]) -> list[Scored]:
        """The scored rollouts of experiments still running (one removed, failed or put
        again since leaves its rollout behind)."""
        ready, self.ready = self.ready, {}
        live = {id(e) for e in running}
        return [s for s in ready.values() if id(s.rollout.exp) in live]

    def _overlap(
        self,
        planned: list[Rollout],
        jobs: Sequence[CompletionJob],
        to_train: list[Scored],
        client_train: Callable[[TrainingStrategy], None] | None,
        phases: dict[str, float],
    ) -> tuple[list[Scored | Failure], list[Trained | Failure]]:
        """Generate and score ``planned`` (and serve ``jobs``) while ``to_train`` trains;
        one after the other where the sampler is the trainer's model or steps aside."""
        generating = bool(planned or jobs)
        together = generating and bool(to_train) and not self._shares_device()
        if not together:
            scored = self._generate_and_score(planned, jobs, phases) if generating else []
            with self.backend.training_phase() if to_train else nullcontext():
                trained = self._timed_train(to_train, client_train, phases)
            return scored, trained
        with ThreadPoolExecutor(1, thread_name_prefix="loraplex-rollout") as pool:
            rolling = pool.submit(self._generate_and_score, planned, jobs, phases)
            try:
                trained = self._timed_train(to_train, client_train, phases)
            finally:
                # A failed update still waits for the rollout: no backend call may be in
                # flight when the tick returns (or raises).
                scored = rolling.result()
        return scored, trained

    def _shares_device(self) -> bool:
        """The sampler cannot run while the trainer trains: it is the trainer's own model
        (torch), or it sleeps to give the device back (vLLM sleep mode)."""
        return self.backend.shares_trainer_weights or bool(getattr(self.backend, "sleeps", False))

    def _generate_and_score(
        self, planned: list[Rollout], jobs: Sequence[CompletionJob], phases: dict[str, float]
    ) -> list[Scored | Failure]:
        """The rollout thread's work; failures are returned, recorded by the tick thread."""
        t = time.perf_counter()
        rolled = self._rollout(planned, jobs)
        phases["rollout"] += time.perf_counter() - t
        t = time.perf_counter()
        done = [r for r in rolled if isinstance(r, Rollout)]
        out: list[Scored | Failure] = [r for r in rolled if isinstance(r, Failure)]
        out += self._score(done)
        phases["reward"] += time.perf_counter() - t
        return out

    def _timed_train(
        self,
        to_train: list[Scored],
        client_train: Callable[[TrainingStrategy], None] | None,
        phases: dict[str, float],
    ) -> list[Trained | Failure]:
        t = time.perf_counter()
        trained = self._train(to_train) if to_train else []
        if client_train is not None:
            client_train(self.strategy)
        phases["train"] += time.perf_counter() - t
        return trained
