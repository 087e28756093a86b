"""Test helpers are imported one way: from the support package
(`from tests.support.server_specs import small_spec`), never from another test module
and never by bare name off a sys.path entry. Importing a test module runs its module
scope (marks, fixtures, skips) inside another and ties one test's helpers to another's
file; a bare import loads a second copy of the module (two `engine_builders`, two
`child_processes` registries of processes to kill), and a sys.path edit makes one
test's helpers shadow another's."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
PLUGINS = TESTS / "plugins"  # packages pip installs into a site for the engine, not tests


def source_files() -> list[Path]:
    return [p for p in sorted(TESTS.rglob("*.py")) if PLUGINS not in p.parents]


def bench_sources() -> list[Path]:
    return sorted((REPO / "bench").glob("*.py"))


def local_names() -> set[str]:
    """Module names a bare import could find in a tests/ folder put on sys.path."""
    return {p.stem for p in source_files() if p.stem != "__init__"}


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(REPO)}:{line}"


def module_exists(dotted: str) -> bool:
    base = REPO.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def test_no_helper_or_test_module_is_imported_by_bare_name() -> None:
    names = local_names()
    bare = [
        f"{where(path, line)}: import {name}"
        for path in source_files() + bench_sources()
        for line, name in imported(ast.parse(path.read_text()))
        if name.split(".")[0] in names
    ]
    assert not bare, "import these from the tests package (tests.support...):\n" + "\n".join(bare)


def test_every_tests_import_names_a_module_that_is_there() -> None:
    stale = []
    for path in source_files() + bench_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                continue
            if node.module.split(".")[0] == "tests" and not module_exists(node.module):
                stale.append(f"{where(path, node.lineno)}: from {node.module}")
    assert not stale, "imports of a tests module that is not there:\n" + "\n".join(stale)


def is_test_module(dotted: str) -> bool:
    """A `tests.<...>` name with a test module in it."""
    parts = dotted.split(".")
    return parts[0] == "tests" and any(p.startswith("test_") for p in parts)


def imports_of_test_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """Every import of a test module, eager or inside a function: `import tests.a.test_b`,
    `from tests.a.test_b import x` and `from tests.a import test_b`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            hit = next((n for n in names if is_test_module(n)), None)
            if hit:
                out.append((node.lineno, hit))
    return out


def test_no_test_module_imports_another() -> None:
    """Shared helpers live in tests/support/ (fixtures in a conftest.py)."""
    found = [
        f"{where(path, line)}: {name}"
        for path in source_files() + bench_sources()
        for line, name in imports_of_test_modules(ast.parse(path.read_text()))
    ]
    assert not found, "move these helpers to tests/support/:\n" + "\n".join(found)


def sys_path_edits(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("insert", "append", "extend"):
                target = node.func.value
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t.value for t in targets if isinstance(t, ast.Subscript)), None)
            if target is None and isinstance(node, ast.AugAssign):
                target = node.target
        if (
            isinstance(target, ast.Attribute)
            and target.attr == "path"
            and isinstance(target.value, ast.Name)
            and target.value.id == "sys"
        ):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_test_edits_sys_path() -> None:
    edits = [
        where(path, line)
        for path in source_files()
        for line in sys_path_edits(ast.parse(path.read_text()))
    ]
    assert not edits, "sys.path edited (use the tests package instead):\n" + "\n".join(edits)


def test_no_tests_folder_is_on_the_path() -> None:
    """pytest puts the repository root on sys.path (tests/ is a package), never a folder
    inside it; bench/ is there by pyproject's `pythonpath` (its scripts import each other
    by bare name)."""
    inside = [p for p in sys.path if p and TESTS in Path(p).resolve().parents]
    inside += [p for p in sys.path if p and Path(p).resolve() == TESTS]
    assert not inside, inside


def test_the_guard_sees_what_it_guards() -> None:
    """The checks above find what they are for (a check that finds nothing proves nothing)."""
    bad = ast.parse(
        "import sys\nsys.path.insert(0, 'tests/engine')\nsys.path[:0] = ['x']\n"
        "import engine_builders\nfrom test_server_live import small_spec\n"
    )
    assert sys_path_edits(bad) == [2, 3]
    names = local_names()
    assert {"engine_builders", "test_server_live", "child_processes"} <= names
    assert [n for _, n in imported(bad) if n in names] == ["engine_builders", "test_server_live"]
    assert module_exists("tests.support.engine_builders")
    hits = ast.parse(
        "from tests.engine.server.test_server_live import small_spec\n"
        "def f():\n    from tests.operator import test_reconcile\n"
        "import tests.engine.local.test_runner\nfrom tests.support.builders import pool\n"
        "from tests.engine.tenancy import test_reward_bounds as rb\n"
    )
    assert sorted(line for line, _ in imports_of_test_modules(hits)) == [1, 3, 4, 6]
    assert not module_exists("tests.engine.engine_builders")
