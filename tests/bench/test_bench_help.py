"""Every bench script a user runs answers `--help` (exit 0, argparse's usage): one that
cannot import its helpers as a script (tests/ on its path instead of the repository root)
or reads its arguments by hand fails here, not at the start of a long run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO_ROOT

DRIVER = REPO_ROOT / "scripts" / "bench_help.py"
MAIN = 'if __name__ == "__main__":'


def scripts() -> list[Path]:
    return [p for p in sorted((REPO_ROOT / "bench").glob("*.py")) if MAIN in p.read_text()]


def test_every_bench_script_answers_help(tmp_path: Path) -> None:
    # A script that leans on the repository root being on its path, run last: the driver
    # must not lend it one (nor the `tests` modules the scripts before it imported).
    leaning = tmp_path / "leaning.py"
    leaning.write_text(f"from tests.support.paths import REPO_ROOT\n\n{MAIN}\n    pass\n")
    out = tmp_path / "answers.json"
    names = [str(p) for p in scripts()] + [str(leaning)]
    run = subprocess.run(
        [sys.executable, str(DRIVER), "--out", str(out), *names],
        capture_output=True,
        text=True,
        timeout=300,
    )
    answers = {Path(a["script"]).name: a for a in json.loads(out.read_text())}
    guard = answers.pop("leaning.py")
    assert "No module named 'tests'" in guard["error"], guard
    failed = [a for a in answers.values() if a["exit_code"] != 0 or not a["usage"]]
    assert not failed, failed
    assert len(answers) == len(scripts()) >= 30
    assert run.returncode == 1 and run.stderr.count("exit 1") == 1, run.stderr  # the guard's
