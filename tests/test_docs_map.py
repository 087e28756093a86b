"""docs/architecture.md is the map a newcomer reads: short enough to read in a quarter of
an hour, every engine and operator module on it, nothing on it that does not exist, and
every design note it links present."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAP = REPO / "docs" / "architecture.md"
ENGINE = REPO / "trainer-image" / "loraplex_engine"
OPERATOR = REPO / "operator" / "loraplex_operator"
MAX_LINES = 600


def modules(package: Path) -> set[str]:
    return {
        p.relative_to(package).as_posix()
        for p in package.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    }


def named_paths(text: str) -> set[str]:
    """Every `path/like.py` the map names in backticks."""
    return set(re.findall(r"`([\w/]+\.py)`", text))


def test_the_map_is_short() -> None:
    assert len(MAP.read_text().splitlines()) <= MAX_LINES


def test_every_engine_and_operator_module_is_on_the_map() -> None:
    named = named_paths(MAP.read_text())
    missing = (modules(ENGINE) | modules(OPERATOR)) - named
    assert not missing, f"modules missing from docs/architecture.md: {sorted(missing)}"


def test_every_module_the_map_names_exists() -> None:
    known = modules(ENGINE) | modules(OPERATOR)
    others = {
        p.relative_to(REPO).as_posix()
        for top in ("tests", "bench", "scripts")
        for p in (REPO / top).rglob("*.py")
    }
    stale = {p for p in named_paths(MAP.read_text()) if p not in known and p not in others}
    stale = {p for p in stale if not any(o.endswith("/" + p) for o in others)}
    assert not stale, f"docs/architecture.md names what does not exist: {sorted(stale)}"


def test_every_linked_design_note_exists() -> None:
    links = re.findall(r"\]\((design/[\w-]+\.md)\)", MAP.read_text())
    assert links and all((MAP.parent / link).is_file() for link in links)
    notes = {p.name for p in (MAP.parent / "design").glob("*.md")}
    assert notes == {Path(link).name for link in links}  # and none unlisted
