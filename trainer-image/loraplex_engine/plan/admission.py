"""The admission checks of a spec that read more than its plan's limits: the model's
chat template (for the prompts and an environment's observations), ``task.dataset``'s
rows, ``eval.dataset``'s rows and an environment plug-in's verdict on its params. One
check for every door: the engine's PUT (engine._build, experiment.new_experiment) calls
these very functions (it keeps the dataset it opens and the plug-in worker it starts),
and `loraplex-engine run` lists their problems before its model loads (local/checks.py,
the chat template read from the model's files: base_model.TemplateFiles). Imports no
torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from loraplex_engine.data.sources import DatasetSource, resolve_dataset
from loraplex_engine.environments.observations import check_chat_templates, observation_format
from loraplex_engine.evaluation.eval_data import eval_dataset_rows
from loraplex_engine.spec.api_types import CALL_TIMEOUT_S
from loraplex_engine.spec.data_options import DatasetOptions
from loraplex_engine.spec.errors import InvalidSpecError, TaskError
from loraplex_engine.spec.experiment import DATA_TASKS, ExperimentSpec, TaskSpec
from loraplex_engine.tasks.dataset import open_dataset
from loraplex_engine.tenancy.trust import TrustPolicy
from loraplex_engine.tokens import ChatTemplates


@dataclass(frozen=True)
class Resources:
    """What a spec is admitted against beside its plan: the data it may read, the
    model's name (for messages), its chat template (None: not read, as no spec needs
    it: :func:`needs_chat_template`), and the bound on a plug-in's answer."""

    trust: TrustPolicy
    model: str
    codec: ChatTemplates | None = None
    plugin_timeout: float = CALL_TIMEOUT_S


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


def check_task_rows(task: TaskSpec, trust: TrustPolicy, namespace: str) -> None:
    """``task.dataset``'s every row, read as the PUT's task reads it (open_dataset: a
    local JSONL file in place, anything else through the reader process), then closed;
    a TaskError naming the line and the field that is not a row's."""
    source = task_source(task, trust, namespace)
    if source is not None:
        open_dataset(source, {}, None).close()  # its params: plan.check_task's


def resource_problems(
    spec: ExperimentSpec, namespace: str, res: Resources
) -> list[InvalidSpecError]:
    """Every problem of these checks, each on its own (the local runner lists them all)."""
    task = spec.task
    if task is None:  # a client experiment: its client renders and reads
        return []
    ev, env = spec.evaluation, task.environment
    checks: list[Callable[[], object]] = [lambda: check_task_rows(task, res.trust, namespace)]
    if res.codec is not None:
        codec = res.codec
        checks.append(lambda: check_chat_templates(task, codec, res.model))
    if ev is not None and ev.dataset is not None:
        checks.append(lambda: eval_dataset_rows(ev, res.trust, namespace))
    if env is not None:
        # Imported here, as plan/scoring.py does: the plug-in worker's host is not free.
        from loraplex_engine.environments.attach import check_environment

        checks.append(lambda: check_environment(env, res.plugin_timeout, namespace))
    problems = []
    for check in checks:
        try:
            check()
        except InvalidSpecError as e:
            problems.append(e)
        except TaskError as e:
            problems.append(InvalidSpecError(e.message, field=e.field))
    return problems
