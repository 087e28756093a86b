"""Which tests are end-to-end: the `e2e` marker, set from what a test module uses.

A test is e2e when its module starts processes (an engine or gateway server, the operator
harness: kmock, kopf, engines; a subprocess or torch's multiprocessing), when it needs a
pip-installed plug-in site, or when it or its fixtures reach the vLLM worker's interpreter
(the engine starts that process). Everything else runs in the test process on in-memory objects
(the tiny model included): `make test-unit` (`-m "not slow and not e2e"`) runs those.
Derived, not hand-kept: a new test that starts a server is e2e without anyone marking it.
"""

from __future__ import annotations

from types import CodeType, FunctionType, ModuleType

import pytest

# Helpers whose use means processes: servers, the operator harness, clients of a live server.
PROCESS_HELPERS = frozenset(
    f"tests.support.{name}"
    for name in (
        "child_processes",
        "client_driver",
        "deployed",
        "deployed_gateway",
        "faulty_engine",
        "gateway_process",
        "harness",
        "kubelet",
        "live_gateway",
        "prometheus_process",
        "resume_worker",
        "server_process",
        "tinker_clients",
        "train_worker",
    )
)
PROCESS_MODULES = frozenset({"subprocess", "multiprocessing", "torch.multiprocessing"})
# Session fixtures that pip-install a package into a site for an engine process.
PROCESS_FIXTURES = frozenset({"plugins_site", "engine_site"})
# Names whose use means the engine itself starts a process: the vLLM worker runs on the
# interpreter of .venv-vllm, which tests name VLLM_PYTHON.
PROCESS_NAMES = frozenset({"VLLM_PYTHON"})

_seen: dict[str, bool] = {}


def starts_processes(module: ModuleType) -> bool:
    """True when the module imports a process helper or a process-starting stdlib module."""
    if module.__name__ not in _seen:
        _seen[module.__name__] = any(_owner(value) in _all() for value in vars(module).values())
    return _seen[module.__name__]


def _all() -> frozenset[str]:
    return PROCESS_HELPERS | PROCESS_MODULES


def _owner(value: object) -> str | None:
    if isinstance(value, ModuleType):
        return value.__name__
    owner = getattr(value, "__module__", None)
    return owner if isinstance(owner, str) else None


def reaches(code: CodeType, module: ModuleType, names: frozenset[str]) -> bool:
    """True when ``code``, or a function of its module that it calls (at any depth), loads
    one of ``names``."""
    todo, seen = [code], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if names.intersection(current.co_names):
            return True
        todo += [c for c in current.co_consts if isinstance(c, CodeType)]  # closures
        for name in current.co_names:
            value = getattr(module, name, None)
            if isinstance(value, FunctionType) and value.__module__ == module.__name__:
                todo.append(value.__code__)
    return False


def uses_process_names(item: pytest.Item, module: ModuleType) -> bool:
    """The test, or a fixture of its own module, reaches a PROCESS_NAMES name."""
    function = getattr(item, "function", None)
    codes = [function.__code__] if isinstance(function, FunctionType) else []
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info else ():
        codes += [d.func.__code__ for d in defs if isinstance(d.func, FunctionType)]
    return any(reaches(code, module, PROCESS_NAMES) for code in codes)


def mark_e2e(item: pytest.Item) -> None:
    module = getattr(item, "module", None)
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & PROCESS_FIXTURES or (
        module is not None and (starts_processes(module) or uses_process_names(item, module))
    ):
        item.add_marker(pytest.mark.e2e)
