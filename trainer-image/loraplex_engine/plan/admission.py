"""The admission checks of a spec that read more than its plan's limits: the model's
chat template (for the prompts and an environment's observations), ``task.dataset``'s
location and ``eval.dataset``'s rows. One check for every door: the engine's PUT
(engine._build, experiment.new_experiment) calls these very functions, and
`loraplex-engine run` lists their problems before its model loads (local/checks.py,
with the tokenizer read alone: base_model.tokenizer_of). Imports no torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from loraplex_engine.data.sources import DatasetSource, resolve_dataset
from loraplex_engine.environments.observations import check_chat_templates, observation_format
from loraplex_engine.evaluation.eval_data import eval_dataset_rows
from loraplex_engine.spec.data_options import DatasetOptions
from loraplex_engine.spec.errors import InvalidSpecError, TaskError
from loraplex_engine.spec.experiment import DATA_TASKS, ExperimentSpec, TaskSpec
from loraplex_engine.tenancy.trust import TrustPolicy
from loraplex_engine.tokens import TokenCodec


@dataclass(frozen=True)
class Resources:
    """What a spec is admitted against beside its plan: the data it may read, the
    model's name (for messages) and its tokenizer (None: not read, as no spec needs its
    chat template: :func:`needs_chat_template`)."""

    trust: TrustPolicy
    model: str
    codec: TokenCodec | None = None


def needs_chat_template(task: TaskSpec | None) -> bool:
    """Whether ``task`` renders its prompts or its observations through a chat template."""
    if task is None:
        return False
    chat_observations = task.environment is not None and observation_format(task) == "chat"
    return task.chat_template or chat_observations


def task_source(task: TaskSpec, trust: TrustPolicy, namespace: str) -> DatasetSource | None:
    """``task.dataset`` where ``namespace`` may read it (None: the task reads none); a
    TaskError naming the field otherwise."""
    if task.name not in DATA_TASKS or not task.dataset:
        return None
    options = task.dataset_options
    if task.name == "jsonl":  # the older task: JSONL, keys prompt and answer
        options = DatasetOptions(format="jsonl")
    return resolve_dataset(trust, task.dataset, options, namespace)


def resource_problems(
    spec: ExperimentSpec, namespace: str, res: Resources
) -> list[InvalidSpecError]:
    """Every problem of these checks, each on its own (the local runner lists them all)."""
    task = spec.task
    if task is None:  # a client experiment: its client renders and reads
        return []
    ev = spec.evaluation
    checks: list[Callable[[], object]] = [lambda: task_source(task, res.trust, namespace)]
    if res.codec is not None:
        codec = res.codec
        checks.append(lambda: check_chat_templates(task, codec, res.model))
    if ev is not None and ev.dataset is not None:
        checks.append(lambda: eval_dataset_rows(ev, res.trust, namespace))
    problems = []
    for check in checks:
        try:
            check()
        except InvalidSpecError as e:
            problems.append(e)
        except TaskError as e:
            problems.append(InvalidSpecError(e.message, field=e.field))
    return problems
