"""How a task's rollouts are scored, checked at admission before anything is built: the
reward or environment plug-in by name (installed, and allowed for the namespace by the
pool), never both, and an eval only where rows score alone. One check for every door:
the engine's PUT (experiment.py, with the pool's allowlist) and `loraplex-engine run`
before its model loads (local/manifests.py, through plan_problems). Imports no torch."""

from __future__ import annotations

from loraplex_engine.spec.errors import InvalidSpecError, TaskError
from loraplex_engine.spec.experiment import ExperimentSpec
from loraplex_engine.tenancy.plugin_access import PluginAccess

OPEN = PluginAccess()  # no allowlist: one user's local run


def check_scoring(
    spec: ExperimentSpec, namespace: str = "default", access: PluginAccess = OPEN
) -> bool:
    """Whether the task is scored by a plug-in; an ``InvalidSpecError`` naming the field
    when its reward or environment cannot be used here, or its eval does not fit it."""
    task = spec.task
    if task is None:  # a client experiment: its client scores
        return False
    # Imported here: the plug-in attachment pulls in its worker's host (no torch, but
    # not free); a manifest with a bad rank should not wait for it.
    from loraplex_engine.environments.attach import check_plugins, uses_plugins
    from loraplex_engine.evaluation.fit import check_eval_fits

    reward, env = task.reward or "default", task.environment
    try:
        check_eval_fits(spec)
        plugged = uses_plugins(reward, env)
        if plugged:
            check_plugins(reward, env, namespace, access)
    except TaskError as e:
        raise InvalidSpecError(e.message, field=e.field) from None
    return plugged
