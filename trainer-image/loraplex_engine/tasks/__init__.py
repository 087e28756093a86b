"""Task registry: ``spec.task.name`` → task class, and a builder from the spec's fields."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from loraplex_engine.data.sources import DatasetSource
from loraplex_engine.spec.errors import TaskError
from loraplex_engine.tasks.base import Prompt, Task
from loraplex_engine.tasks.builtin import (
    ArithmeticTask,
    CopyTask,
    ShortReplyTask,
    TargetTokenTask,
)
from loraplex_engine.tasks.dataset import DatasetTask, open_dataset
from loraplex_engine.tasks.gsm8k import Gsm8kTask
from loraplex_engine.tasks.jsonl import JsonlTask
from loraplex_engine.tasks.rewards import BUILTIN_REWARDS, make_reward
from loraplex_engine.tenancy.reward_exchange import REWARD_TIMEOUT_S
from loraplex_engine.tenancy.trust import RewardEgress

TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (
        TargetTokenTask,
        CopyTask,
        ArithmeticTask,
        ShortReplyTask,
        Gsm8kTask,
        JsonlTask,
        DatasetTask,
    )
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
    reward_timeout: float = REWARD_TIMEOUT_S,
    *,
    dataset_root: Path | None = None,
    allow_hard_links: bool = False,
    reward_egress: RewardEgress | None = None,
    source: DatasetSource | None = None,
) -> Task:
    """A ready task; raises ``TaskError`` naming the offending spec field.

    ``dataset`` is read as given: the engine resolves and checks it first (tenancy/trust.py) and
    passes the directory it must stay in as ``dataset_root`` (and whether a file with
    several hard links is allowed), or the checked ``source`` (data/sources.py: what the
    jsonl and dataset tasks read, wherever it is); ``reward_egress`` bounds
    where an http reward may be sent (None: anywhere)."""
    params = dict(params or {})
    check_task(name, params)
    if reward not in REWARD_NAMES:
        raise TaskError("spec.task.reward", f"unknown reward {reward!r}; known: {REWARD_NAMES}")
    if reward == "http" and not reward_url:
        raise TaskError("spec.task.rewardUrl", "required when reward is http")
    if reward == "http" and reward_egress is not None:
        reward_egress.check(str(reward_url), resolve_required=False)
    reward_obj = (
        None
        if reward == "default"
        else make_reward(reward, reward_url, reward_timeout, egress=reward_egress)
    )
    if source is not None and name in ("jsonl", "dataset"):
        return open_dataset(source, params, reward_obj)
    if name == "dataset":
        raise TaskError("spec.task.dataset", "required for task dataset")
    if name == "jsonl":
        if not dataset:
            raise TaskError("spec.task.dataset", "required for task jsonl")
        return JsonlTask(
            dataset, params, reward_obj, root=dataset_root, allow_hard_links=allow_hard_links
        )
    return TASKS[name](params, reward_obj)


__all__ = [
    "REWARD_NAMES",
    "TASKS",
    "ArithmeticTask",
    "CopyTask",
    "DatasetTask",
    "Gsm8kTask",
    "JsonlTask",
    "Prompt",
    "ShortReplyTask",
    "TargetTokenTask",
    "Task",
    "build_task",
    "check_task",
]
