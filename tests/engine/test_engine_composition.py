"""The Engine is composed, not inherited: its parts (clients/, versions/, the tick) are
handed the collaborators they use by name (clients/parts.py's ClientParts,
versions/service.py's VersionRoutes, engine_parts.py), so none of them reaches into the
Engine. Read from the source (ast):

- no module but engine.py reads one of the Engine's private attributes (``_model_lock``,
  ``_wake``, ``_experiments``...) of anything but ``self``;
- clients/ and versions/ take no ``host`` (the Engine, untyped) and no ``self: Protocol``
  (a mixin's view of its host);
- the Engine inherits no mixin.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trainer-image" / "loraplex_engine"
ENGINE = "engine.py"
PARTS = ("clients", "versions")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _engine_class(package: Path) -> ast.ClassDef:
    tree = _tree(package / ENGINE)
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")


def engine_private_names(package: Path = PACKAGE) -> set[str]:
    """The Engine's private attributes: ``self._x = ...`` anywhere in it, its ``_x``
    methods and annotated ``_x`` class attributes."""
    names: set[str] = set()
    for node in ast.walk(_engine_class(package)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name[:1] == "_":
            names.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _where(path: Path, node: ast.AST, package: Path) -> str:
    return f"{path.relative_to(package.parent)}:{getattr(node, 'lineno', 0)}"


def private_reads(package: Path = PACKAGE) -> list[str]:
    """Every read, outside engine.py, of an Engine private attribute of something other
    than ``self`` / ``cls`` (``host._model_lock``, ``getattr(engine, "_wake")``)."""
    private = engine_private_names(package)
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == package / ENGINE:
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Attribute) and node.attr in private:
                own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if not own:
                    found.append(f"{_where(path, node, package)} {ast.unparse(node)}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in private
            ):
                found.append(f"{_where(path, node, package)} {ast.unparse(node)}")
    return found


def host_uses(package: Path = PACKAGE) -> list[str]:
    """In clients/ and versions/: any ``host`` (a parameter, a name, an attribute, a field)
    and any method whose ``self`` is annotated (a mixin's Protocol view of its host)."""
    found = []
    for folder in PARTS:
        for path in sorted((package / folder).rglob("*.py")):
            for node in ast.walk(_tree(path)):
                named = (
                    (isinstance(node, ast.arg) and node.arg == "host")
                    or (isinstance(node, ast.Name) and node.id == "host")
                    or (isinstance(node, ast.Attribute) and node.attr == "host")
                )
                if named:
                    found.append(f"{_where(path, node, package)} host")
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.args.args:
                    first = node.args.args[0]
                    if first.arg == "self" and first.annotation is not None:
                        found.append(f"{_where(path, node, package)} self: {ast.unparse(first)}")
    return found


def engine_bases(package: Path = PACKAGE) -> list[str]:
    return [ast.unparse(b) for b in _engine_class(package).bases if ast.unparse(b) != "object"]


def test_the_engine_has_private_attributes_to_guard() -> None:
    """The check below looks for these; an empty set would make it pass vacuously."""
    assert {"_model_lock", "_wake", "_experiments"} <= engine_private_names()


def test_no_module_outside_engine_py_reads_an_engine_private_attribute() -> None:
    assert private_reads() == []


def test_clients_and_versions_take_no_untyped_host() -> None:
    assert host_uses() == []


def test_the_engine_inherits_no_mixin() -> None:
    assert engine_bases() == []
