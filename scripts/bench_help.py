#!/usr/bin/env python3
"""Asks each bench script for `--help` as `python bench/x.py --help` would, all in one
interpreter (torch and the rest load once: a process a script costs seconds each).

    scripts/bench_help.py                      every bench/*.py with a __main__
    scripts/bench_help.py --out A.json X.py..  those scripts; the answers as JSON

Each script runs as ``__main__`` with its own folder first on sys.path and the repository
root off it, as a script run starts; what the script before it imported from the checkout
(``tests.*``, its siblings) is forgotten first, so a script that cannot find the test
helpers on its own fails here too. Exit 1 when a script does not answer (exit 0 and
argparse's ``usage:``). tests/bench/test_bench_help.py runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAIN = 'if __name__ == "__main__":'


@dataclass
class HelpAnswer:
    script: str
    exit_code: int | None  # None: the script returned without exiting
    usage: bool  # it printed argparse's `usage:` line
    error: str  # the exception it raised, if any

    @property
    def answered(self) -> bool:
        return self.exit_code == 0 and self.usage


def bench_scripts() -> list[Path]:
    return [p for p in sorted((REPO / "bench").glob("*.py")) if MAIN in p.read_text()]


def forget_checkout_modules(folder: Path) -> None:
    """Drop the test helpers and the script folder's modules the last script imported."""
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        mine = file is not None and Path(file).resolve().parent == folder
        if name == "tests" or name.startswith("tests.") or mine:
            del sys.modules[name]


def ask_help(script: Path, base_path: list[str]) -> HelpAnswer:
    folder = script.resolve().parent
    forget_checkout_modules(folder)
    sys.path[:] = [str(folder), *base_path]
    sys.argv[:] = [str(script), "--help"]
    out = io.StringIO()
    code: int | None = None
    error = ""
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:  # every failure is the answer, and the next script still runs
        code, error = 1, f"{type(e).__name__}: {e}"
    return HelpAnswer(str(script), code, "usage:" in out.getvalue(), error)


def main() -> None:
    ap = argparse.ArgumentParser(description="Every bench script answers --help.")
    ap.add_argument("scripts", nargs="*", type=Path, help="default: bench/*.py with a __main__")
    ap.add_argument("--out", type=Path, help="write every answer here as JSON")
    args = ap.parse_args()
    # The interpreter's path less this script's folder and the root (neither a script has).
    here = Path(__file__).resolve().parent
    base = [p for p in sys.path[1:] if p and Path(p).resolve() not in (REPO, here)]
    answers = [ask_help(s, base) for s in args.scripts or bench_scripts()]
    if args.out:
        args.out.write_text(json.dumps([asdict(a) for a in answers]))
    failed = [a for a in answers if not a.answered]
    for a in failed:
        print(f"{a.script}: exit {a.exit_code} {a.error}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
