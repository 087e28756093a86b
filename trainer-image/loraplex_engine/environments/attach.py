"""A task whose reward or environment is an installed plug-in: the names checked against
what the engine has installed (discovery.py; an unknown one is the PUT's 422, listing the
installed ones), and the experiment's plug-in worker started (host.py): an environment's
params checked there at once (its ``check_params``; a bad one is the PUT's 422)."""

from __future__ import annotations

from loraplex_engine.environments.session import EnvironmentSession
from loraplex_engine.plugins.discovery import installed
from loraplex_engine.plugins.host import PluginHost
from loraplex_engine.plugins.reward import PluginReward
from loraplex_engine.spec.errors import PluginError, TaskError
from loraplex_engine.spec.plugins import BUILTIN_REWARDS, EnvironmentSpec
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
        session = EnvironmentSession(environment, host)
        try:  # bad params are the PUT's 422, not the first episode's failure
            session.check()
        except (TaskError, PluginError) as e:
            session.close()
            if isinstance(e, TaskError):
                raise
            raise TaskError("spec.task.environment.name", str(e)) from e
        task.environment = session
    else:
        task.reward_fn = PluginReward(reward, host)
    return task
