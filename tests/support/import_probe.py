"""`loraplex-engine ARGS` in a fresh interpreter that reports, after the command, which
heavy modules (torch, transformers) it imported: a one-line error must not cost them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import loraplex_engine

# The package under test, first on the child's path (a relative PYTHONPATH would not
# survive its cwd, and the venv's editable install may point at another checkout).
SOURCE = str(Path(loraplex_engine.__file__).resolve().parents[1])
HEAVY = ("torch", "transformers")
# Runs main() and then prints, as the last stdout line, the heavy modules imported.
PROBE = """
import sys
from loraplex_engine.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(__import__("json").dumps([m for m in {heavy!r} if m in sys.modules]))
sys.exit(code)
"""


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[int, str, list[str]]:
    """(exit status, stderr, heavy modules imported) of ``loraplex-engine ARGS``."""
    r = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": SOURCE, **(env or {})},
    )
    return r.returncode, r.stderr, json.loads(r.stdout.splitlines()[-1])


# Builds the CLI's parser (what `--help` and every command do first) and prints the
# modules of the package named that it imported.
PARSER_PROBE = """
import sys
from loraplex_engine.cli import build_parser
build_parser()
package = {package!r}
print(__import__("json").dumps(sorted(
    m for m in sys.modules if m == package or m.startswith(package + ".")
)))
"""


def parser_imports(package: str) -> list[str]:
    """The modules of ``package`` that building `loraplex-engine`'s parser imports, in a
    fresh interpreter."""
    r = subprocess.run(
        [sys.executable, "-c", PARSER_PROBE.format(package=package)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": SOURCE},
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])
