"""A task whose reward or environment is an installed plug-in: the names checked against
what the engine has installed (discovery.py; an unknown one is the PUT's 422, listing the
installed ones), and the experiment's plug-in worker started (host.py): an environment's
params checked there at once (its ``check_params``; a bad one is the PUT's 422)."""

from __future__ import annotations

from loraplex_engine.environments.session import EnvironmentSession
from loraplex_engine.plugins.discovery import environment_names, reward_names
from loraplex_engine.plugins.host import PluginHost
from loraplex_engine.plugins.reward import PluginReward
from loraplex_engine.spec.errors import PluginError, TaskError
from loraplex_engine.spec.plugins import BUILTIN_REWARDS, EnvironmentSpec
from loraplex_engine.tasks.base import Task
from loraplex_engine.tenancy.plugin_access import PluginAccess

OPEN = PluginAccess()  # no allowlist


def _listed(names: tuple[str, ...]) -> str:
    return ", ".join(names) if names else "none"


def uses_plugins(reward: str, environment: EnvironmentSpec | None) -> bool:
    return environment is not None or reward not in BUILTIN_REWARDS


def check_plugins(
    reward: str,
    environment: EnvironmentSpec | None,
    namespace: str = "default",
    access: PluginAccess = OPEN,
) -> None:
    """``TaskError`` naming the field when a name is not one ``namespace`` may use (the
    pool's allowlist), is not installed, or both are set. The listings name only what
    the namespace may use: another team's plug-ins stay unnamed."""
    if environment is not None:
        if reward != "default":
            raise TaskError(
                "spec.task.reward",
                "not used with task.environment (the environment scores its episodes)",
            )
        names = environment_names(environment.name)
        _check_one("environment", environment.name, names, namespace, access)
    else:
        _check_one("reward", reward, reward_names(), namespace, access)


_FIELDS = {"reward": "spec.task.reward", "environment": "spec.task.environment.name"}


def _check_one(
    kind: str, name: str, installed_names: tuple[str, ...], namespace: str, access: PluginAccess
) -> None:
    usable = access.allowed(namespace, kind, installed_names)
    if not access.allows(namespace, kind, name):
        raise TaskError(
            _FIELDS[kind],
            f"{kind} plug-in {name!r} is not allowed for namespace {namespace!r} by this "
            f"pool (EnginePool spec.plugins.allowed); it may use: {_listed(usable)}",
        )
    if name not in installed_names:
        built_in = f"built in: {', '.join(BUILTIN_REWARDS)}; " if kind == "reward" else ""
        raise TaskError(
            _FIELDS[kind],
            f"unknown {kind} {name!r}; {built_in}{kind} plug-ins installed in this engine: "
            f"{_listed(usable)}",
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
            check_session(session)
        except TaskError:
            session.close()
            raise
        task.environment = session
    else:
        task.reward_fn = PluginReward(reward, host)
    return task


def check_session(session: EnvironmentSession) -> None:
    """The environment's verdict on its params (its ``check_params``, in its worker): a
    ``TaskError`` naming the param, or the environment when it cannot answer."""
    try:
        session.check()
    except PluginError as e:
        raise TaskError("spec.task.environment.name", str(e)) from e


def check_environment(environment: EnvironmentSpec, timeout: float, owner: str) -> None:
    """:func:`check_session` in a worker of its own, closed after: what `run` asks before
    its model loads (plan/admission.py); the engine's PUT asks the worker it keeps."""
    session = EnvironmentSession(
        environment, PluginHost(owner, f"environment:{environment.name}", timeout)
    )
    try:
        check_session(session)
    finally:
        session.close()
