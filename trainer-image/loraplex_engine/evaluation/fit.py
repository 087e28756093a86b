"""Whether a spec's eval fits its task: a check of the spec alone (no torch), made at
admission (plan/scoring.py) before anything is built."""

from __future__ import annotations

from loraplex_engine.spec.errors import TaskError
from loraplex_engine.spec.experiment import ExperimentSpec


def check_eval_fits(spec: ExperimentSpec) -> None:
    """``TaskError`` on ``spec.eval`` when the task cannot be evaluated so."""
    if spec.evaluation is None or spec.task is None or spec.task.environment is None:
        return
    # An eval is single-turn rows scored by the task's reward; an environment's reward
    # scores whole episodes, so an eval here would measure something else.
    raise TaskError(
        "spec.eval",
        "spec.eval is not supported with task.environment (multi-turn episodes): "
        "leave spec.eval unset",
    )
