"""bench/placement_bench.py still runs and reports what
docs/design/operator-placement.md quotes from it: a small run (50 experiments onto 10
engines) and the shape of its output, not speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "bench" / "placement_bench.py"

SCENARIOS = {
    "all-at-once/rank-first",
    "all-at-once/slots-first",
    "batches-of-50",
    "uniform-8-slot-engines/three-quarters-load",
}


def _run(experiments: int, engines: int) -> list[dict[str, Any]]:
    args = ["--experiments", str(experiments), "--engines", str(engines)]
    out = subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines()]


def _check_result(r: dict[str, Any], experiments: int, engines: int) -> None:
    lb = r["lower_bound"]
    assert r["rounds"] >= 1 and r["decision_seconds"] >= 0
    assert 0 < r["bound"] <= experiments and 0 < r["engines_used"] <= engines
    assert lb["best"] == max(lb["slots"], lb["rank"], lb["memory"])
    # A lower bound on the engines that hold what was bound: never above what was used.
    assert 1 <= lb["best"] <= r["engines_used"]
    assert r["efficiency"] == round(lb["best"] / r["engines_used"], 3) and r["efficiency"] <= 1
    assert 0 < r["slot_fill_of_used_engines"] <= 1


def test_small_run_reports_every_scenario_well_formed() -> None:
    header, *results = _run(experiments=50, engines=10)
    assert (header["experiments"], header["engines"]) == (50, 10)
    assert header["total_slots"] >= 10 * 4  # the smallest engine kind has 4 slots
    assert {r["scenario"] for r in results} == SCENARIOS and len(results) == len(SCENARIOS)
    for r in results:
        _check_result(r, experiments=50, engines=10)
    batched = next(r for r in results if r["scenario"] == "batches-of-50")
    assert batched["rounds"] == 1  # 50 experiments arrive in one batch of 50
