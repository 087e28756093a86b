"""A task whose reward or environment is an installed plug-in: the names checked against
what the engine has installed (discovery.py; an unknown one is the PUT's 422, listing the
installed ones), and the experiment's plug-in worker started (host.py)."""

from __future__ import annotations

from loraplex_engine.environments.session import EnvironmentSession
from loraplex_engine.errors import TaskError
from loraplex_engine.plugins.discovery import installed
from loraplex_engine.plugins.host import PluginHost
from loraplex_engine.plugins.reward import PluginReward
from loraplex_engine.spec_blocks.plugins import BUILTIN_REWARDS, EnvironmentSpec
from loraplex_engine.tasks.base import Task


def _listed(names: tuple[str, ...]) -> str:
    return ", ".join(names) if names else "none"


def uses_plugins(reward: str, environment: EnvironmentSpec | None) -> bool:
    return environment is not None or reward not in BUILTIN_REWARDS


def check_plugins(reward: str, environment: EnvironmentSpec | None) -> None:
    """``TaskError`` naming the field when a name is not installed, or both are set."""
    found = installed()
    if environment is not None:
        if reward != "default":
            raise TaskError(
                "spec.task.reward",
                "not used with task.environment (the environment scores its episodes)",
            )
        if environment.name not in found.environments:
            raise TaskError(
                "spec.task.environment.name",
                f"unknown environment {environment.name!r}; installed in this engine: "
                f"{_listed(found.environments)}",
            )
    elif reward not in found.rewards:
        raise TaskError(
            "spec.task.reward",
            f"unknown reward {reward!r}; built in: {', '.join(BUILTIN_REWARDS)}; reward "
            f"plug-ins installed in this engine: {_listed(found.rewards)}",
        )


def plug_in(
    task: Task, reward: str, environment: EnvironmentSpec | None, timeout: float, owner: str
) -> Task:
    """``task`` scored by its plug-in (checked by :func:`check_plugins` first)."""
    plugin = f"environment:{environment.name}" if environment else f"reward:{reward}"
    host = PluginHost(owner, plugin, timeout)
    if environment is not None:
        task.environment = EnvironmentSession(environment, host)
    else:
        task.reward_fn = PluginReward(reward, host)
    return task
