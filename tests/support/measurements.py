"""Numbers tests keep for the docs' reports, in JSON files under out/.

Test workers run side by side (pytest-xdist), so each read-modify-write of a report file
holds an exclusive lock on a file beside it: no worker's number overwrites another's.
"""

from __future__ import annotations

import fcntl
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.paths import REPO_ROOT

OUT = REPO_ROOT / "out"


def update(report: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``change`` to the report's JSON object under the report's lock."""
    report.parent.mkdir(parents=True, exist_ok=True)
    with open(report.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data = json.loads(report.read_text())
        except (OSError, ValueError):
            data = {}
        change(data)
        report.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def record_seconds(report: Path, name: str, seconds: float) -> None:
    """One wall time in seconds, rounded to milliseconds."""
    update(report, lambda data: data.__setitem__(name, round(seconds, 3)))
    print(f"measure {name}: {seconds:.2f}s")


def record_value(report: Path, name: str, value: float | None, note: str = "") -> None:
    """One number with what it means and when it was taken."""
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    update(report, lambda data: data.__setitem__(name, {"value": value, "note": note, "at": at}))
    print(f"measurement {name} = {value} ({note})", file=sys.stderr)
