"""An experiment's spec compiled once against the engine's limits (plan/limits.py) into a
typed, frozen plan: its adapter, optimiser, task, algorithm, rollout, step cost, and its
checkpoint, publish, tracking and eval policies. Every engine-side check of a spec is
here, each raising an InvalidSpecError naming its field; the engine, the client
experiments and the local runner's pre-load check all build from it. Free of torch, so
a manifest is checked before any heavy import."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loraplex_engine.lora.config import LoRAConfig
from loraplex_engine.plan.client import client_lora_config
from loraplex_engine.plan.limits import EngineLimits
from loraplex_engine.plan.scoring import check_scoring
from loraplex_engine.spec.algorithm import AlgorithmSpec
from loraplex_engine.spec.checkpoint import CheckpointSpec
from loraplex_engine.spec.client import ClientSpec
from loraplex_engine.spec.errors import InvalidRequestError, InvalidSpecError, TaskError
from loraplex_engine.spec.eval import EvalSpec
from loraplex_engine.spec.experiment import ExperimentSpec, RolloutSpec, TaskSpec
from loraplex_engine.spec.publish import PublishSpec
from loraplex_engine.spec.tracking import TrackingSpec
from loraplex_engine.spec.training_service import ClientLora
from loraplex_engine.train.optim_settings import AdamWSettings, adamw_settings


@dataclass(frozen=True)
class ExperimentPlan:
    """What the engine runs for one spec; ``spec`` is kept as given (stored with its
    checkpoints, compared on a repeated PUT), the rest is read from here."""

    spec: ExperimentSpec
    lora: LoRAConfig
    optimizer: AdamWSettings
    seed: int  # the adapter's initial weights and the prompt order
    algorithm: AlgorithmSpec
    rollout: RolloutSpec
    task: TaskSpec | None  # None: a client experiment
    client: ClientSpec | None  # a client experiment's model (spec/client.py)
    client_lora: ClientLora | None  # its adapter, as Tinker's lora_config asks for one
    checkpoint: CheckpointSpec
    publish: PublishSpec | None
    tracking: TrackingSpec
    evaluation: EvalSpec | None
    step_tokens: int | None  # the most tokens one step (its eval included) may cost

    @property
    def max_steps(self) -> int:
        return self.algorithm.max_steps

    def republished(self, publish: PublishSpec | None) -> ExperimentPlan:
        """This plan with another publish block (applied in place, the run going on)."""
        spec = self.spec.model_copy(update={"publish": publish})
        return dataclasses.replace(self, spec=spec, publish=publish)


def compile_plan(spec: ExperimentSpec, limits: EngineLimits) -> ExperimentPlan:
    """The plan of a validated ``spec`` on an engine with ``limits`` (its model's modules
    known); the first problem as an InvalidSpecError naming its field."""
    if limits.target_modules is None:
        raise ValueError("a plan needs the base model's target modules")
    lora = check_lora(spec, limits)
    assert lora is not None  # the modules are known
    check_task(spec)
    return ExperimentPlan(
        spec=spec,
        lora=lora,
        optimizer=adamw_settings(spec.algorithm),
        seed=spec.algorithm.seed,
        algorithm=spec.algorithm,
        rollout=spec.rollout,
        task=spec.task,
        client=spec.client,
        client_lora=client_lora(spec),
        checkpoint=spec.checkpoint,
        publish=spec.publish,
        tracking=spec.tracking,
        evaluation=spec.evaluation,
        step_tokens=check_step(spec, limits),
    )


def plan_problems(spec: ExperimentSpec, limits: EngineLimits) -> list[InvalidSpecError]:
    """Every problem compile_plan would find, and the admission's scoring check (with no
    allowlist: plan/scoring.py), each check on its own (the local runner lists them all,
    before its model loads); checks ``limits`` does not know enough for are left out."""
    problems = []
    checks = (check_lora, lambda s, _: check_task(s), check_step, lambda s, _: check_scoring(s))
    for check in checks:
        try:
            check(spec, limits)
        except InvalidSpecError as e:
            problems.append(e)
    return problems


def client_lora(spec: ExperimentSpec) -> ClientLora | None:
    """A client experiment's adapter (spec/client.py), as Tinker's lora_config asks."""
    c = spec.client
    if c is None:
        return None
    return ClientLora(spec.lora.rank, c.seed, c.train_attn, c.train_mlp, c.train_unembed)


def check_lora(spec: ExperimentSpec, limits: EngineLimits) -> LoRAConfig | None:
    """The adapter ``spec.lora`` (or spec.client) asks for; None where the model's
    modules are not known."""
    problem = limits.rank_problem(spec.lora.rank)
    if problem is not None:
        raise InvalidSpecError(problem, field="spec.lora.rank")
    lora = client_lora(spec)
    if lora is not None:
        if limits.target_modules is None:
            return None
        try:
            return client_lora_config(lora, limits)[0]
        except InvalidRequestError as e:
            raise InvalidSpecError(e.message, field="spec.client") from e
    named = tuple(spec.lora.target_modules) if spec.lora.target_modules else None
    problem = limits.targets_problem(named)
    if problem is not None:
        raise InvalidSpecError(problem, field="spec.lora.targetModules")
    targets = named or limits.default_targets
    if targets is None:
        return None
    return LoRAConfig(spec.lora.rank, spec.lora.alpha, spec.lora.dropout, targets)


def check_task(spec: ExperimentSpec) -> None:
    """The task's params (free-form in the schema) against the task's known ones."""
    if spec.task is None:  # a client experiment
        return
    # Imported here: tasks pull in httpx; checking a manifest should not need it.
    from loraplex_engine.tasks import check_task as check_params

    try:
        check_params(spec.task.name, spec.task.params)
    except TaskError as e:
        raise InvalidSpecError(e.message, field=e.field) from None


def check_step(spec: ExperimentSpec, limits: EngineLimits) -> int | None:
    """The most tokens a step may cost, within the engine's limits; None where they are
    not known or the experiment has no steps of its own (a client's)."""
    if limits.work is None or spec.task is None:
        return None
    return limits.work.check_step(spec)
