"""The engine's folders are layers (trainer-image/loraplex_engine/layers.py): a module
imports only from its own folder and from the folders below it, so the folders form no
import cycle and a reader can take in one layer knowing only those under it.

Imports are read from the source (ast): a module's own and a function's own (lazy)
imports alike. One under ``if TYPE_CHECKING:`` is exempt: it never runs, and it names a
type only (train/ and rollout/ annotate with parallel/'s Lockstep that way).
docs/architecture.md's layer table is generated from the same data and checked here.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loraplex_engine.layers import LAYERS, layer_of, order

from tests.support.graphs import cycles

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "trainer-image" / "loraplex_engine"
NAME = PACKAGE.name
DOCS = REPO / "docs" / "architecture.md"
BEGIN = "<!-- layers: generated from trainer-image/loraplex_engine/layers.py -->"
END = "<!-- /layers -->"


@dataclass(frozen=True)
class Edge:
    source: str  # folder (or root module) that imports
    target: str  # folder (or root module) imported
    where: str  # path:line, from the package's parent
    module: str  # what is imported


def folder_of(path: Path) -> str | None:
    """The first name under the package: its folder, or the root module's name."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return None if parts == ("__init__",) else parts[0]


def folders() -> set[str]:
    return {f for p in PACKAGE.rglob("*.py") if (f := folder_of(p)) is not None}


def type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            for inner in node.body:
                lines |= set(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def imported(path: Path, source: str | None = None) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every import in ``path``, the names a ``from`` takes
    included (``from loraplex_engine import cli`` imports cli)."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    skip = type_checking_lines(tree)
    package = ".".join(path.relative_to(PACKAGE.parent).parent.parts)
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def edges(package: Path = PACKAGE) -> list[Edge]:
    known = folders()
    found = []
    for path in sorted(package.rglob("*.py")):
        source = folder_of(path)
        for line, name in imported(path):
            parts = name.split(".")
            if parts[0] != NAME or len(parts) < 2 or parts[1] not in known:
                continue
            if parts[1] != source:
                where = f"{path.relative_to(PACKAGE.parent)}:{line}"
                found.append(Edge(source or NAME, parts[1], where, name))
    return found


def upward(found: list[Edge], rank: dict[str, int]) -> list[Edge]:
    return [e for e in found if e.source != NAME and rank[e.target] > rank[e.source]]


def graph_of(found: list[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in found:
        graph.setdefault(e.source, set()).add(e.target)
    return graph


def render() -> str:
    """docs/architecture.md's layer table: top first, as one reads down the stack."""
    rows = ["| layer | folder | what it holds |", "|---|---|---|"]
    for layer in reversed(LAYERS):
        for i, (name, holds) in enumerate(reversed(layer.folders)):
            shown = f"`{name}/`" if (PACKAGE / name).is_dir() else f"`{name}.py`"
            head = f"**{layer.name}**: {layer.why}" if i == 0 else ""
            rows.append(f"| {head} | {shown} | {holds} |")
    return "\n".join([BEGIN, *rows, END])


# ---------------------------------------------------------------- the package


def test_every_folder_is_in_a_layer_and_every_layer_folder_exists() -> None:
    declared = set(order())
    assert len(declared) == sum(len(layer.folders) for layer in LAYERS), "a folder twice"
    assert folders() - declared == set(), "add these to loraplex_engine/layers.py"
    assert declared - folders() == set(), "layers.py names what does not exist"


def test_no_folder_imports_a_folder_above_it() -> None:
    rank, layer = order(), layer_of()
    bad = upward(edges(), rank)
    lines = [
        f"{e.where}: {e.source} ({layer[e.source]}) imports {e.module} "
        f"({e.target}, {layer[e.target]}, above it)"
        for e in bad
    ]
    assert not lines, "upward imports:\n" + "\n".join(lines)


def test_the_folders_form_no_import_cycle() -> None:
    found = edges()
    loops = cycles(graph_of(found))
    detail = [
        f"{e.where}: {e.source} -> {e.module}"
        for loop in loops
        for e in found
        if e.source in loop and e.target in loop
    ]
    assert loops == [], f"folder cycles {loops}:\n" + "\n".join(detail)


def test_the_docs_table_is_the_layers_data() -> None:
    text = DOCS.read_text()
    match = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), text, re.S)
    assert match, f"docs/architecture.md lacks the generated layer table ({BEGIN})"
    assert match.group(0) == render(), "regenerate it: print(render()) here\n" + render()


# ------------------------------------------------------------ the checks themselves


def test_an_upward_import_and_a_cycle_are_found() -> None:
    rank = {"spec": 0, "train": 1, "engine": 2}
    found = [
        Edge("train", "spec", "a.py:1", "loraplex_engine.spec.errors"),
        Edge("spec", "engine", "b.py:7", "loraplex_engine.engine"),
        Edge("engine", "train", "c.py:3", "loraplex_engine.train"),
    ]
    assert [e.where for e in upward(found, rank)] == ["b.py:7"]
    assert cycles(graph_of(found)) == [["engine", "spec", "train"]]
    assert cycles(graph_of(found[:1] + found[2:])) == []


def test_lazy_imports_count_and_type_checking_ones_do_not() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from loraplex_engine.engine import Engine\n"
        "def f():\n"
        "    from loraplex_engine.tick import tick\n"
        "from . import errors\n"
    )
    names = sorted(imported(PACKAGE / "spec" / "schema.py", source))
    assert names == [
        (1, "typing.TYPE_CHECKING"),
        (5, "loraplex_engine.tick.tick"),
        (6, "loraplex_engine.spec.errors"),
    ]
