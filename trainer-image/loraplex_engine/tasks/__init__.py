"""Task registry: ``spec.task.name`` → task class, and a builder from the spec's fields."""

from __future__ import annotations

from collections.abc import Mapping

from loraplex_engine.errors import TaskError
from loraplex_engine.rewards import BUILTIN_REWARDS, make_reward
from loraplex_engine.tasks.base import Prompt, Task
from loraplex_engine.tasks.builtin import ArithmeticTask, CopyTask, TargetTokenTask
from loraplex_engine.tasks.jsonl import JsonlTask

TASKS: dict[str, type[Task]] = {
    cls.name: cls for cls in (TargetTokenTask, CopyTask, ArithmeticTask, JsonlTask)
}

# "default" = the task's own verifier; the others replace it.
REWARD_NAMES: tuple[str, ...] = ("default", *BUILTIN_REWARDS, "http")


def check_task(name: str, params: Mapping[str, str]) -> None:
    """Validate name and params without touching files or the network."""
    if name not in TASKS:
        raise TaskError("spec.task.name", f"unknown task {name!r}; known: {sorted(TASKS)}")
    TASKS[name].parse_params(params)


def build_task(
    name: str,
    params: Mapping[str, str] | None = None,
    dataset: str | None = None,
    reward: str = "default",
    reward_url: str | None = None,
    reward_timeout: float = 30.0,
) -> Task:
    """A ready task; raises ``TaskError`` naming the offending spec field."""
    params = dict(params or {})
    check_task(name, params)
    if reward not in REWARD_NAMES:
        raise TaskError("spec.task.reward", f"unknown reward {reward!r}; known: {REWARD_NAMES}")
    if reward == "http" and not reward_url:
        raise TaskError("spec.task.rewardUrl", "required when reward is http")
    reward_obj = None if reward == "default" else make_reward(reward, reward_url, reward_timeout)
    if name == "jsonl":
        if not dataset:
            raise TaskError("spec.task.dataset", "required for task jsonl")
        return JsonlTask(dataset, params, reward_obj)
    return TASKS[name](params, reward_obj)


__all__ = [
    "REWARD_NAMES",
    "TASKS",
    "ArithmeticTask",
    "CopyTask",
    "JsonlTask",
    "Prompt",
    "TargetTokenTask",
    "Task",
    "build_task",
    "check_task",
]
