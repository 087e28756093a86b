"""The pipelined schedule (``--schedule pipelined``; docs/design/pipeline.md).

The sync tick (tick/tick.py) rolls out every due experiment, scores, trains and syncs them,
in that order: while it trains nothing generates. Here a tick trains the experiments
whose rollouts are already scored (the previous tick's) while the rollouts of the others
generate and score, on a thread: with vLLM in its own process the two use different
cores (or devices). Per experiment the stages stay in order (generate → score → train →
sync), so with ``algorithm.maxStaleness`` 0 an experiment never generates in the tick
that trains it, and samples with the weights of its own last update: on-policy, as in the
sync tick. With maxStaleness k > 0 its next rollout may start while up to k of its
updates have not landed (the one being made this tick, scored rollouts waiting for
theirs, rewards still pending: :class:`Lane`), from the weights before them: at most k
steps stale, corrected by the PPO ratio against the sampler's log-probs (torch rollout)
or TIS (vLLM, ``offPolicyCorrection: tis``). An experiment's rollouts train in the order
they started, one a tick. Every trained step reports the version its rollout was sampled
with (``ExperimentTick.rollout_version``).

Every backend call finishes inside the tick (the rollout thread is joined before the
trained adapters sync), so adding and removing experiments between ticks is as safe as
under the sync tick. A rollout that shares the trainer's weights (torch) overlaps the
update only on CUDA, on a side stream, when its slots are not the update's and both
working sets fit (rollout/torch/streams.py); otherwise the stages run one after the
other, rollout first (a stale rollout then samples the pre-update weights, as recorded).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch

from loraplex_engine.completion_jobs import CompletionJob
from loraplex_engine.experiment import Experiment
from loraplex_engine.parallel.distributed import World
from loraplex_engine.rollout.torch.streams import (
    SideStream,
    StaticFacts,
    TickFacts,
    overlap_blocker,
    static_blocker,
)
from loraplex_engine.settings.engine import SCHEDULES
from loraplex_engine.spec.api_types import TICK_PHASES, MemoryPlan, TickReport
from loraplex_engine.spec.errors import AdapterError, UsageError
from loraplex_engine.tick.fair_share import due_to_roll_out
from loraplex_engine.tick.results import Failure, Rollout, Scored, Trained, failed, guarded, keep
from loraplex_engine.tick.tick import Tick
from loraplex_engine.train.strategy import TrainingStrategy

log = logging.getLogger("loraplex_engine.tick")


def tick_class(schedule: str, world: World | None = None) -> type[Tick]:
    """The tick of ``schedule``: the sync one, or this pipelined one."""
    if schedule not in SCHEDULES:
        raise UsageError(f"schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")
    if schedule == "pipelined" and world is not None:
        raise UsageError("--schedule pipelined runs on one rank; data parallelism needs sync")
    return PipelinedTick if schedule == "pipelined" else Tick


def max_staleness(exp: Experiment) -> int:
    return exp.plan.algorithm.max_staleness


def may_roll_out(exp: Experiment, pending: int) -> bool:
    """``exp`` may start a rollout this tick while ``pending`` of its updates have not
    landed (each lands before this rollout's own, which is then ``pending`` steps stale):
    at most its maxStaleness, and never a rollout past its last step (but for the eval of
    its last adapter, spec.eval, once every update has landed)."""
    if exp.finished_steps:
        return pending == 0 and exp.eval_due()
    if pending == 0:
        return True
    beyond_last = exp.max_steps > 0 and exp.step + pending >= exp.max_steps
    return pending <= max_staleness(exp) and not beyond_last


def _owner(item: Trained | Failure) -> Experiment:
    return item.exp if isinstance(item, Failure) else item.scored.rollout.exp


def _client_trains(client_train: Callable[[TrainingStrategy], None] | None) -> bool:
    """Client models train in this tick: the engine passes its client tick's ``train``
    every tick (clients/ticking.py), which trains only when it took train calls."""
    if client_train is None:
        return False
    owner = getattr(client_train, "__self__", None)
    return bool(getattr(owner, "segments", True))


def fill_split(due: list[Experiment]) -> list[Experiment]:
    """Who rolls out when nothing trains (the first tick, or after a pause): half of the
    on-policy experiments, so that from the next tick on one half trains while the other
    generates. Experiments allowing staleness overlap with themselves and all go."""
    strict = [e for e in due if max_staleness(e) == 0]
    if len(strict) < 2:
        return due
    first = {id(e) for e in strict[: (len(strict) + 1) // 2]}
    return [e for e in due if max_staleness(e) > 0 or id(e) in first]


@dataclass
class Lane:
    """One experiment's rollouts from their start to their update, in the order they
    started (by the tick that planned them): the head trains first, once scored."""

    exp: Experiment
    started: deque[int] = field(default_factory=deque)  # planned ticks, oldest first
    scored: dict[int, Scored] = field(default_factory=dict)  # their rewards are back

    def head(self) -> Scored | None:
        return self.scored.get(self.started[0]) if self.started else None

    def take_head(self) -> Scored | None:
        """The oldest rollout if it is scored (its update is made now), else None."""
        head = self.head()
        if head is not None:
            del self.scored[self.started.popleft()]
        return head

    def file(self, s: Scored) -> bool:
        """Keep a scored rollout until its turn; False: not one of this lane's (started
        before the experiment left the running set)."""
        if s.rollout.planned_tick not in self.started:
            return False
        self.scored[s.rollout.planned_tick] = s
        return True


class PipelinedTick(Tick):
    """Trains earlier ticks' scored rollouts while this tick's generate (module doc)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        # Per experiment id: its rollouts between their start and their update.
        self.lanes: dict[str, Lane] = {}
        # The torch rollout beside the update on CUDA (attach_streams); why not, if not.
        self.streams: SideStream | None = None
        self.memory_plan: MemoryPlan | None = None
        self.stream_blocker: str | None = "not attached"
        self.side_stream_ticks = 0  # ticks whose rollout ran on the side stream

    def attach_streams(self, device: torch.device, plan: MemoryPlan) -> None:
        """Called once the memory plan is made: a side stream where the torch rollout may
        ever run beside training (rollout/torch/streams.py), else the reason it may not."""
        config = self.model.base_model.config
        facts = StaticFacts(
            device_type=device.type,
            torch_rollout=self.backend.shares_trainer_weights,
            single_process=getattr(self.backend, "lockstep", None) is None
            and getattr(self.backend, "distribute", None) is None,
            checkpointing=bool(getattr(self.strategy, "gradient_checkpointing", False)),
            attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
        )
        self.memory_plan, self.stream_blocker = plan, static_blocker(facts)
        self.streams = SideStream(device) if self.stream_blocker is None else None

    def has_work(self, running: list[Experiment]) -> bool:
        if self.scorer.has_arrived() or self.episodes.has_arrived():
            return True
        for e in running:
            lane = self._lane_of(e)
            pending = len(lane.started) if lane else 0
            if pending == 0 and not self.scorer.waits(e):  # idle: as under the sync tick
                return True
            if lane and (lane.head() is not None or self._may_start(e, pending)):
                return True
        return False

    def _plan(self, exp: Experiment) -> Rollout:
        # the tick that planned it orders the experiment's rollouts in its lane
        return replace(super()._plan(exp), planned_tick=self.count)

    def _lane_of(self, exp: Experiment) -> Lane | None:
        lane = self.lanes.get(exp.id)
        return lane if lane is not None and lane.exp is exp else None

    def _may_start(self, exp: Experiment, pending: int) -> bool:
        """Rewards allow it (on-policy: none pending; else its namespace has room), no
        multi-turn step of its is in play, and :func:`may_roll_out` allows it."""
        blocked = self.scorer.waits(exp) if max_staleness(exp) == 0 else None
        if blocked is None:
            blocked = self.scorer.namespace_full(exp)
        # A multi-turn step still in play (environments/player.py): one at a time.
        blocked = blocked or self.episodes.waits(exp.task.environment)
        return not blocked and may_roll_out(exp, pending)

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
        self._prune(running)
        self._file(keep(self.scorer.arrived(running), failures))
        to_train = [s for e in running if (s := self._take_head(e)) is not None]
        training = {id(s.rollout.exp) for s in to_train}
        eligible = [e for e in running if self._may_start(e, self._pending(e, training))]
        due = due_to_roll_out(eligible, self.count)
        if not to_train:
            due = fill_split(due)
        plans = [guarded(e, "task_error", "task", lambda e=e: self._plan(e)) for e in due]
        planned = keep(plans, failures)
        for r in planned:
            self._lane(r.exp).started.append(r.planned_tick)
        scored, trained = self._overlap(planned, jobs, to_train, client_train, phases)
        fresh = keep(scored, failures)
        self._file(fresh)
        # A stale experiment can fail in its next rollout (its task, reward) while its
        # update is made: failed, it does not step (its last checkpoint stands).
        lost = {id(f.exp) for f in failures}
        trained = keep([t for t in trained if id(_owner(t)) not in lost], failures)
        t = time.perf_counter()
        synced, sync = self._sync(trained)
        trained = keep(synced, failures)
        phases["sync"] += time.perf_counter() - t
        t = time.perf_counter()
        # An eval scored while its own update was made, or after (maxStaleness > 0),
        # scored an adapter steps back: its scores join the next version, the latest before.
        evaluated = [s for s in fresh if s.eval is not None]
        for s in evaluated if self.publisher is not None else ():
            exp = s.rollout.exp
            if id(exp) in training or (s.eval is not None and exp.step != s.eval.step):
                exp.published.last_eval = s.eval
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

    def _prune(self, running: list[Experiment]) -> None:
        """Drop the lanes of experiments no longer running (one removed, failed or put
        again since leaves its rollouts behind; its prompt stream has moved past them)."""
        live = {e.id: e for e in running}
        self.lanes = {k: v for k, v in self.lanes.items() if live.get(k) is v.exp}

    def _lane(self, exp: Experiment) -> Lane:
        lane = self._lane_of(exp)
        if lane is None:
            lane = self.lanes[exp.id] = Lane(exp)
        return lane

    def _file(self, scored: list[Scored]) -> None:
        for s in scored:
            if not self._lane(s.rollout.exp).file(s):
                log.info(
                    "experiment %s: dropped a rollout started before a pause", s.rollout.exp.id
                )

    def _take_head(self, exp: Experiment) -> Scored | None:
        lane = self._lane_of(exp)
        return lane.take_head() if lane is not None else None

    def _pending(self, exp: Experiment, training: set[int]) -> int:
        """``exp``'s updates not landed yet: its rollouts started and not trained, and
        the one it trains this tick (that update lands after this tick's rollouts start)."""
        lane = self._lane_of(exp)
        return (len(lane.started) if lane else 0) + (id(exp) in training)

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
        both = generating and bool(to_train)
        side = self._side_stream(planned, jobs, to_train, client_train) if both else None
        together = both and (side is not None or not self._shares_device())
        if not together:
            scored = self._generate_and_score(planned, jobs, phases) if generating else []
            with self.backend.training_phase() if to_train else nullcontext():
                trained = self._timed_train(to_train, client_train, phases)
            return scored, trained
        ready = side.launch() if side is not None else None
        with ThreadPoolExecutor(1, thread_name_prefix="loraplex-rollout") as pool:
            rolling = pool.submit(self._rollout_thread, side, ready, planned, jobs, phases)
            try:
                trained = self._timed_train(to_train, client_train, phases)
            finally:
                # A failed update still waits for the rollout: no backend call may be in
                # flight when the tick returns (or raises).
                try:
                    scored = rolling.result()
                finally:
                    if side is not None:
                        side.join()
        return scored, trained

    def _rollout_thread(
        self,
        side: SideStream | None,
        ready: torch.cuda.Event | None,
        planned: list[Rollout],
        jobs: Sequence[CompletionJob],
        phases: dict[str, float],
    ) -> list[Scored | Failure]:
        if side is None or ready is None:
            return self._generate_and_score(planned, jobs, phases)
        with side.generating(ready):
            return self._generate_and_score(planned, jobs, phases)

    def _side_stream(
        self,
        planned: list[Rollout],
        jobs: Sequence[CompletionJob],
        to_train: list[Scored],
        client_train: Callable[[TrainingStrategy], None] | None,
    ) -> SideStream | None:
        """The side stream if this tick's rollout may run on it beside the update."""
        if self.streams is None:
            return None
        why = overlap_blocker(
            self.memory_plan, self._tick_facts(planned, jobs, to_train, client_train)
        )
        self.stream_blocker = why
        if why is not None:
            log.debug("torch rollout and update one after the other: %s", why)
            return None
        self.side_stream_ticks += 1
        return self.streams

    def _tick_facts(
        self,
        planned: list[Rollout],
        jobs: Sequence[CompletionJob],
        to_train: list[Scored],
        client_train: Callable[[TrainingStrategy], None] | None,
    ) -> TickFacts:
        requests = [q for r in planned for q in r.all_requests()]
        slots = {q.slot for q in requests}
        for job in jobs:
            slots.add(0 if job.slot_name is None else self._slot_or_base(job.slot_name))
        rollout_tokens = sum(len(q.prompt_ids) + q.max_new_tokens for q in requests)
        if any(r.episodes is not None for r in planned) or jobs:  # later turns, job rows
            cap = self.memory_plan.rollout_kv_tokens if self.memory_plan else None
            rollout_tokens = max(rollout_tokens, cap or 0)  # as much as its budget allows
        train_tokens = sum(
            len(q.prompt_ids) + len(c.token_ids)
            for s in to_train
            for q, c in zip(s.rollout.requests, s.rollout.completions, strict=False)
        )
        dropout = frozenset().union(*(x.dropout_slots for x in self.model.lora_layers.values()))
        return TickFacts(
            rollout_slots=frozenset(slots),
            trained_slots=frozenset(self.model.slot_of(s.rollout.exp.id) for s in to_train),
            dropout_slots=dropout,
            client_train=_client_trains(client_train),
            train_tokens=train_tokens,
            train_adapters=len(to_train),
            rollout_tokens=rollout_tokens,
        )

    def _slot_or_base(self, name: str) -> int:
        try:
            return self.model.slot_of(name)
        except AdapterError:  # its experiment left: the rollout answers it as not found
            return 0

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
