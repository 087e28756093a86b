"""The module the chart's `kopf run -m` names registers every kopf handler of the operator.

kopf imports that module and runs whatever it registered; a module that registers none
gives an operator that starts, answers its probes, and reconciles nothing. Each check
imports the module in a fresh interpreter (kopf's registry is process-global) and
compares what kopf registered with the handlers the operator's source declares.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from tests.support.chart_helpers import REPO, SCENARIOS, operator_deployment, render

OPERATOR_SRC = REPO / "operator" / "loraplex_operator"

COUNT_HANDLERS = """
import importlib, json, sys
import kopf
importlib.import_module(sys.argv[1])
registry = kopf.get_default_registry()
names = [
    f"{h.fn.__module__}.{h.fn.__name__}"
    for part in vars(registry).values() if hasattr(part, "get_all_handlers")
    for h in part.get_all_handlers()
]
print(json.dumps(names))
"""


def registered_handlers(module: str) -> list[str]:
    """`module.function` of every operator handler kopf holds after importing `module`
    alone (kopf's own, e.g. its login via an installed Kubernetes client, are left out)."""
    proc = subprocess.run(
        [sys.executable, "-c", COUNT_HANDLERS, module],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"importing {module} failed:\n{proc.stderr}"
    names = json.loads(proc.stdout.strip().splitlines()[-1])
    return [n for n in names if n.startswith("loraplex_operator.")]


def _is_kopf_decorator(node: ast.expr) -> bool:
    func = node.func if isinstance(node, ast.Call) else node
    while isinstance(func, ast.Attribute):
        func = func.value
    return isinstance(func, ast.Name) and func.id == "kopf"


def declared_handlers() -> set[str]:
    """Functions in the operator's source with a `@kopf....` decorator."""
    found = set()
    for path in sorted(OPERATOR_SRC.glob("*.py")):
        module = f"loraplex_operator.{path.stem}"
        for node in ast.walk(ast.parse(path.read_text())):
            is_def = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if is_def and any(_is_kopf_decorator(d) for d in node.decorator_list):
                found.add(f"{module}.{node.name}")
    return found


def chart_module(values: dict) -> str:
    """The module after `-m` in the operator container's rendered args."""
    container = operator_deployment(render(values))["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert container["command"] == ["kopf"] and args[0] == "run", container
    return args[args.index("-m") + 1]


@pytest.mark.parametrize("scenario", ["default", "namespaced"])
def test_module_the_chart_names_registers_every_handler(scenario: str) -> None:
    declared = declared_handlers()
    assert len(declared) >= 8, (
        declared
    )  # startup, cleanup, probe, the pool daemon, 4 on experiments
    registered = registered_handlers(chart_module(SCENARIOS[scenario]))
    assert sorted(registered) == sorted(declared), "registered once each, all of them"


def test_the_package_alone_registers_nothing() -> None:
    """Why the chart names the handlers module: the package registers nothing on import,
    so tools and tests can import its helpers (manifests, metrics) without side effects."""
    assert registered_handlers("loraplex_operator") == []
