"""Where the pace tests live, so that `make test` runs them alone, after the parallel pass.

A pace test measures a tenant's rate beside an attacker or a co-tenant and compares it
with the same tenant's rate alone, moments before. `make test` runs the suite on two
pytest-xdist workers; a neighbouring worker's engine starting up between the two windows
is exactly the load such a test must not see, so these modules carry the `pace` marker,
the parallel pass deselects them, and a second pass runs them one at a time.

    python -m tests.support.pace      prints the files, relative to the repository
"""

from __future__ import annotations

from pathlib import Path

from tests.support.paths import REPO_ROOT

TESTS = REPO_ROOT / "tests"
MARK = "mark.pace"


def pace_files(root: Path = TESTS) -> list[Path]:
    """Every test module that names the marker, sorted."""
    return sorted(p for p in root.rglob("test_*.py") if MARK in p.read_text())


def main() -> None:
    print(" ".join(str(p.relative_to(REPO_ROOT)) for p in pace_files()))


if __name__ == "__main__":
    main()
