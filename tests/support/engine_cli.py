"""The installed `loraplex-engine` console command in a process of its own, and the
check that a user's mistake at it is one stderr line with exit status 2."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.support.server_process import engine_command

TIMEOUT_S = 120


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stdout: str
    stderr: str


def engine_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> Outcome:
    """The installed console command, in a process of its own."""
    r = subprocess.run(
        [*engine_command(), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )
    return Outcome(r.returncode, r.stdout, r.stderr)


def assert_usage_error(r: Outcome, *named: str) -> str:
    """Status 2 and one stderr line, without a traceback, naming each of ``named``."""
    lines = r.stderr.splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for what in named:
        assert what in lines[0], (what, lines[0])
    return lines[0]
