"""One loaded experiment: its plan (its spec compiled against the engine, plan/), task,
RNGs and progress, and how a plan is turned into one."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import torch

from loraplex_engine.environments.attach import plug_in
from loraplex_engine.evaluation.eval_set import EvalSet, build_eval_set
from loraplex_engine.plan.admission import task_source
from loraplex_engine.plan.experiment import ExperimentPlan
from loraplex_engine.plan.scoring import check_scoring
from loraplex_engine.spec.api_types import (
    CALL_TIMEOUT_S,
    DETERMINISTIC_FAILURES,
    CheckpointRef,
    ExperimentPhase,
    ExperimentStatus,
    VersionSummary,
)
from loraplex_engine.spec.errors import ConflictError, InvalidSpecError, TaskError
from loraplex_engine.spec.eval_scores import EvalResult, eval_due
from loraplex_engine.spec.experiment import ExperimentSpec
from loraplex_engine.tasks import Task, build_task
from loraplex_engine.tenancy.trust import TrustPolicy
from loraplex_engine.tracking.run_ids import new_run_id
from loraplex_engine.train.algorithms import Algorithm, build_algorithm


@dataclass
class PublishState:
    """An experiment's versions as the engine tracks them (Experiment.published; the
    decisions over them are versions/policy.py's, the I/O versions/publisher.py's)."""

    window: list[float] = field(default_factory=list)  # step rewards since the last version
    recent: list[VersionSummary] = field(default_factory=list)  # newest last
    aliases: dict[str, int] = field(default_factory=dict)
    error: str | None = None  # the last publish's or alias update's problem
    # The latest eval (spec.eval) of this placement: its scores join the next version's.
    last_eval: EvalResult | None = None
    # An everySteps version due at this step waits for the eval of the same step.
    awaiting_eval: int | None = None
    # The best eval score of each kind among the published versions (onEvalImprovement).
    best: dict[str, float] = field(default_factory=dict)
    # The last publish.requestToken published (store/versions.py keeps it on disk).
    token: str | None = None


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass
class Experiment:
    """Everything the engine keeps for one loaded experiment."""

    id: str
    namespace: str
    name: str
    plan: ExperimentPlan  # its spec compiled against this engine (plan/experiment.py)
    task: Task
    algorithm: Algorithm
    prompt_rng: random.Random  # which prompts; seeded from plan.seed
    sample_gen: torch.Generator  # which tokens; seeded likewise
    phase: ExperimentPhase = "Running"
    step: int = 0
    reward: float | None = None
    rollout_tokens: int = 0
    train_tokens: int = 0
    checkpoint: CheckpointRef | None = None
    adapter_path: str | None = None
    error: str | None = None
    started_at: str = field(default_factory=now)
    updated_at: str = field(default_factory=now)
    # Ties this run's checkpoints together across engines and names their directory
    # (store/run_store.py): given by the caller (the operator: the object's uid), or made at a
    # fresh start and carried over on resume.
    run_id: str = field(default_factory=new_run_id)  # readable, as `run`'s (tracking/run_ids.py)
    failure_reason: str | None = None  # FAILURE_REASONS entry, with ``error``
    logprob_gap: float | None = None  # of the latest step (api_types.ExperimentStatus)
    tis_weight_mean: float | None = None  # likewise
    skipped_updates: int = 0  # steps dynamic sampling left without an update
    # A due checkpoint met a full volume (StorageFullError): retried every tick; a
    # finished experiment is Succeeded only once its last checkpoint is written.
    checkpoint_pending: bool = False
    # Fair share (tick/fair_share.py): tokens of the last step planned, and that tick's number.
    step_cost: int = 0
    rolled_out_at: int = -(1 << 62)
    # Published versions and aliases (versions/publisher.py), read from disk at placement.
    published: PublishState = field(default_factory=PublishState)
    # spec.eval (evaluation/): its fixed prompts, the step of the latest eval planned (its
    # rows rolled out) and of the latest result, and the tokens every eval cost so far.
    eval_set: EvalSet | None = None
    eval_planned: int | None = None
    last_eval: EvalResult | None = None
    eval_tokens: int = 0

    @property
    def spec(self) -> ExperimentSpec:
        """The spec as given (stored with checkpoints, compared on a repeated PUT)."""
        return self.plan.spec

    @property
    def max_steps(self) -> int:
        return self.plan.max_steps

    @property
    def finished_steps(self) -> bool:
        """Its last step is done (maxSteps > 0 reached)."""
        return self.max_steps > 0 and self.step >= self.max_steps

    def eval_due(self) -> bool:
        """The adapter at this step is to be evaluated and no eval of it is planned yet."""
        if self.eval_set is None:
            return False
        every = self.eval_set.spec.every_steps
        return eval_due(self.step, every, self.eval_planned, self.finished_steps)

    def awaits_final_eval(self) -> bool:
        """Finished training, but the eval of its last adapter has no result yet: it
        stays Running until it has."""
        if self.eval_set is None or not self.finished_steps:
            return False
        return self.last_eval is None or self.last_eval.step != self.step

    def fail(self, error: str, reason: str) -> None:
        """Fail this experiment alone: ``error`` says what happened, ``reason`` is its
        kind (a FAILURE_REASONS entry)."""
        self.phase, self.error, self.updated_at = "Failed", error, now()
        self.failure_reason = reason
        self.task.close()  # its plug-in worker, reward connections: nothing more to score

    def status(self) -> ExperimentStatus:
        return ExperimentStatus(
            id=self.id,
            namespace=self.namespace,
            name=self.name,
            phase=self.phase,
            step=self.step,
            max_steps=self.max_steps,
            reward=self.reward,
            rollout_tokens=self.rollout_tokens,
            train_tokens=self.train_tokens,
            checkpoint=self.checkpoint,
            adapter_path=self.adapter_path,
            error=self.error,
            started_at=self.started_at,
            updated_at=self.updated_at,
            run_id=self.run_id,
            failure_reason=self.failure_reason,
            deterministic_failure=self.failure_reason in DETERMINISTIC_FAILURES,
            logprob_gap=self.logprob_gap,
            tis_weight_mean=self.tis_weight_mean,
            skipped_updates=self.skipped_updates,
            checkpoint_pending=self.checkpoint_pending,
            versions=list(self.published.recent),
            aliases={a: f"v{n}" for a, n in sorted(self.published.aliases.items())},
            publish_error=self.published.error,
            publish_request_token=self.published.token,
            publish=None if self.plan.publish is None else self.plan.publish.to_json(),
            **eval_status(self.last_eval, self.eval_tokens),
        )


def eval_status(result: EvalResult | None, tokens: int) -> dict[str, Any]:
    """ExperimentStatus's eval fields: the latest eval's (None before the first)."""
    if result is None:
        return {"eval_tokens": tokens}
    return {
        "eval_step": result.step,
        "eval_reward": result.reward,
        "eval_pass_at_k": result.pass_at_k,
        "eval_k": result.k,
        "eval_tokens": tokens,
    }


def new_experiment(
    exp_id: str,
    plan: ExperimentPlan,
    namespace: str,
    name: str,
    run_id: str | None,
    trust: TrustPolicy,
    plugin_timeout: float = CALL_TIMEOUT_S,
) -> Experiment:
    """The experiment ``plan`` describes, at step 0 (its adapter is not loaded yet); an
    unknown task, reward or algorithm, or a dataset or reward URL ``trust`` does not
    allow, is an InvalidSpecError naming the field."""
    spec, task_spec = plan.spec, plan.task
    assert task_spec is not None  # a client experiment is clients/experiments.py's
    try:
        source = task_source(task_spec, trust, namespace)  # as `run` checks before load
        reward, env = task_spec.reward or "default", task_spec.environment
        plugged = check_scoring(spec, namespace, trust.plugins)  # as `run` checks before load
        task = build_task(
            task_spec.name,
            task_spec.params,
            None,
            "default" if plugged else reward,
            task_spec.reward_url,
            reward_egress=trust.egress,
            source=source,
        )
        if plugged:
            try:  # an environment's params are checked here (environments/attach.py)
                plug_in(task, reward, env, plugin_timeout, exp_id)
            except BaseException:
                task.close()  # its dataset's descriptors
                raise
        algorithm = build_algorithm(plan.algorithm, plan.rollout.max_new_tokens)
        try:
            eval_set = build_eval_set(spec, task, trust, namespace)
        except BaseException:
            task.close()  # its dataset's descriptors, its reward's client
            raise
    except TaskError as e:
        raise InvalidSpecError(e.message, field=e.field) from e
    except KeyError as e:
        raise InvalidSpecError(str(e), field="spec.algorithm.name") from e
    seed = plan.seed
    exp = Experiment(
        id=exp_id,
        namespace=namespace,
        name=name,
        plan=plan,
        task=task,
        algorithm=algorithm,
        prompt_rng=random.Random(seed),
        sample_gen=torch.Generator().manual_seed(seed),
        eval_set=eval_set,
    )
    if run_id is not None:
        exp.run_id = run_id
    return exp


def adapter_spec(spec: ExperimentSpec) -> dict[str, Any]:
    """The spec minus operator-only fields (pool, priority class, suspend) and what the
    engine applies in place (publish): what the engine runs."""
    return spec.model_dump(
        exclude={"engine_pool", "priority_class_name", "priority", "suspend", "publish"}
    )


def check_same(existing: Experiment, spec: ExperimentSpec, run_id: str | None) -> bool:
    """A PUT of a loaded experiment is a no-op only with its spec and run, but for its
    publish block, which the engine applies in place: True when that changed."""
    if adapter_spec(existing.spec) != adapter_spec(spec):
        raise ConflictError(
            f"experiment {existing.id!r} is loaded with a different spec; "
            "DELETE it first to change its spec"
        )
    if run_id is not None and run_id != existing.run_id:
        raise ConflictError(
            f"experiment {existing.id!r} is loaded as run {existing.run_id!r}, "
            f"not runId {run_id!r}; DELETE it first to start another run"
        )
    return existing.spec.publish != spec.publish
