"""What plug-ins are installed: entry points by group, skyrl-gym's registered ids, and
verifiers environments (``verifiers:<module>``: every installed distribution that
requires verifiers, by its top-level modules that export a verifiers ``Taskset``, which
is how verifiers itself finds a taskset: an importable module, its ``__all__``).

Listing skyrl-gym's ids imports skyrl_gym (and pandas, ~2 s), verifiers' ~3 s, and a broken plug-in
package may fail or hang on import: so the engine lists them in a child process once
(:func:`installed`), bounded, and never imports plug-in code itself.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from importlib import metadata

REWARD_GROUP = "loraplex.rewards"
ENVIRONMENT_GROUP = "loraplex.environments"
VERIFIERS_PREFIX = "verifiers:"
LIST_TIMEOUT_S = 60.0
log = logging.getLogger("loraplex_engine.plugins")


@dataclass(frozen=True)
class Installed:
    """Names a spec may use: ``task.reward`` among ``rewards``; ``task.environment.name``
    among ``environments`` (entry points first, then skyrl-gym ids)."""

    rewards: tuple[str, ...] = ()
    environments: tuple[str, ...] = ()
    problems: tuple[str, ...] = field(default=(), compare=False)  # why a listing is partial

    def to_json(self) -> dict[str, list[str]]:
        return {"rewards": list(self.rewards), "environments": list(self.environments)}


def entry_point_names(group: str) -> list[str]:
    return sorted({ep.name for ep in metadata.entry_points(group=group)})


def load_entry_point(group: str, name: str) -> object:
    """The object an entry point names (imports its module: plug-in code, worker only)."""
    for ep in metadata.entry_points(group=group):
        if ep.name == name:
            return ep.load()
    raise KeyError(f"no {group} entry point named {name!r}")


def skyrl_gym_ids() -> list[str]:
    """Environment ids registered with skyrl-gym (none when it is not installed)."""
    try:
        import skyrl_gym
    except ImportError:
        return []
    return sorted(skyrl_gym.registry)


def verifiers_ids() -> tuple[list[str], list[str]]:
    """``verifiers:<module>`` for each installed verifiers environment (none when
    verifiers is not installed), and the problems met (a module that fails to import)."""
    modules = sorted(
        {
            module
            for module, dists in metadata.packages_distributions().items()
            for dist in dists
            if _requires_verifiers(dist) and module.isidentifier()
        }
    )
    if not modules:  # verifiers itself is not imported (~3 s) for nothing
        return [], []
    try:
        from verifiers.v1.taskset import Taskset
    except ImportError as e:
        return [], [f"verifiers environments {', '.join(modules)}: verifiers: {e}"]
    ids, problems = [], []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception as e:  # a broken environment package is listed as a problem
            problems.append(f"verifiers environment {name}: {type(e).__name__}: {e}")
            continue
        exported = [getattr(module, n, None) for n in getattr(module, "__all__", ())]
        if any(isinstance(c, type) and issubclass(c, Taskset) for c in exported):
            ids.append(VERIFIERS_PREFIX + name)
    return ids, problems


def _requires_verifiers(dist: str) -> bool:
    try:
        requires = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return False
    return any(re.match(r"verifiers\b(?![-_.\w])", r) for r in requires)


def list_here() -> Installed:
    """The listing, computed in this process (the child's side of :func:`installed`)."""
    envs = entry_point_names(ENVIRONMENT_GROUP)
    problems: list[str] = []
    try:
        gym = skyrl_gym_ids()
    except Exception as e:  # a broken skyrl-gym install lists its entry points only
        gym, problems = [], [f"skyrl-gym: {type(e).__name__}: {e}"]
    try:
        vf, vf_problems = verifiers_ids()
    except Exception as e:  # a broken verifiers install lists the others
        vf, vf_problems = [], [f"verifiers: {type(e).__name__}: {e}"]
    return Installed(
        tuple(entry_point_names(REWARD_GROUP)),
        tuple(envs + [i for i in gym if i not in envs] + vf),
        tuple(problems + vf_problems),
    )


def reward_names() -> tuple[str, ...]:
    """The reward plug-ins :func:`installed` lists (entry points only, no plug-in code
    imported), without its child process: a reward is checked in milliseconds."""
    return tuple(entry_point_names(REWARD_GROUP))


def environment_names(name: str) -> tuple[str, ...]:
    """The environments to check ``name`` against: the entry points when it is one of them
    (milliseconds), else the full listing of :func:`installed` (seconds, once)."""
    entry_points = tuple(entry_point_names(ENVIRONMENT_GROUP))
    return entry_points if name in entry_points else installed().environments


_cache: Installed | None = None
_lock = threading.Lock()


def installed() -> Installed:
    """The engine's listing, computed once in a child process (bounded)."""
    global _cache
    with _lock:
        if _cache is None:
            _cache = _list_in_child()
            for problem in _cache.problems:
                log.warning("plug-ins: %s", problem)
        return _cache


def _list_in_child() -> Installed:
    cmd = [sys.executable, "-m", "loraplex_engine.environments.worker", "--list"]
    try:
        done = subprocess.run(
            cmd, capture_output=True, timeout=LIST_TIMEOUT_S, check=False, stdin=subprocess.DEVNULL
        )
        data = json.loads(done.stdout.decode().strip().splitlines()[-1])
        return Installed(
            tuple(data["rewards"]), tuple(data["environments"]), tuple(data["problems"])
        )
    except subprocess.TimeoutExpired:
        why = f"listing the installed plug-ins took over {LIST_TIMEOUT_S:.0f}s"
    except (ValueError, KeyError, IndexError) as e:
        why = f"listing the installed plug-ins failed ({type(e).__name__})"
    # Entry points alone need no import of plug-in code: list those, say what is missing.
    return Installed(
        tuple(entry_point_names(REWARD_GROUP)), tuple(entry_point_names(ENVIRONMENT_GROUP)), (why,)
    )
