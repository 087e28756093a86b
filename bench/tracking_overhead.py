#!/usr/bin/env python3
"""What experiment tracking costs the engine loop per tick, with trackers up, down or hung.

    PYTHONPATH=trainer-image .venv/bin/python bench/tracking_overhead.py [--ticks 2000]

Times ``Tracking.observe_tick`` (tracking/hub.py), the one call the engine loop makes per
tick, on a report of 8 stepping experiments, in each scenario: no tracker; a tracker that
takes everything at once; one that hangs forever (its queue fills, then drops the oldest);
MLflow's real client (tracking/mlflow_tracker.py) at a port where nothing listens
(refused at once, retried with backoff); and at a port that accepts and never answers
(each call waits out the 10 s request timeout). The trackers run on their own threads
throughout, so a scenario's ticks share the CPU with them. Prints the per-tick seconds
(median, p99, max) and the tracker's series; writes bench/results/tracking-overhead.json.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loraplex_engine import metrics  # noqa: F401  no _created series, as in `serve`
from loraplex_engine.spec.api_types import ExperimentTick, TickReport
from loraplex_engine.tracking.hub import Tracking
from loraplex_engine.tracking.records import StepRecord
from prometheus_client import CollectorRegistry

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "tracking-overhead.json"
EXPERIMENTS = 8


class Instant:
    name = "instant"

    def log(self, records: Sequence[StepRecord]) -> None:
        pass

    def close(self) -> None:
        pass


class Hung:
    name = "hung"

    def __init__(self) -> None:
        self.release = threading.Event()

    def log(self, records: Sequence[StepRecord]) -> None:
        self.release.wait()

    def close(self) -> None:
        pass


def report(step: int) -> TickReport:
    ticks = [
        ExperimentTick(
            f"ns{i}.exp{i}", f"ns{i}", step, 0.5, 64, 192, name=f"exp{i}", run_id=f"run{i}",
            reward_std=0.1, kl=0.01, entropy=1.2, clip_fraction=0.05, response_tokens=8.0,
        )
        for i in range(EXPERIMENTS)
    ]  # fmt: skip
    return TickReport(0.1, {}, ticks)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name: str, trackers: list[Any], ticks: int, queue: int) -> dict[str, Any]:
    registry = CollectorRegistry()
    tracking = Tracking(trackers, registry, queue, "bench")
    seconds = []
    for step in range(1, ticks + 1):
        r = report(step)
        t = time.perf_counter()
        tracking.observe_tick(r)
        seconds.append(time.perf_counter() - t)
    series = {
        f"{s.name}{{{s.labels.get('tracker', '')}}}": s.value
        for family in registry.collect()
        for s in family.samples
    }
    for tracker in trackers:  # let a hung one go, so close() is quick
        getattr(tracker, "release", threading.Event()).set()
    tracking.close(timeout=1.0)
    seconds.sort()
    row = {
        "scenario": name,
        "ticks": ticks,
        "median_us": statistics.median(seconds) * 1e6,
        "p99_us": seconds[int(0.99 * len(seconds))] * 1e6,
        "max_us": seconds[-1] * 1e6,
        "series": series,
    }
    print(
        f"{name:28s} median {row['median_us']:8.1f} us  p99 {row['p99_us']:8.1f} us  "
        f"max {row['max_us']:9.1f} us"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ticks", type=int, default=2000)
    parser.add_argument("--queue", type=int, default=10_000)
    args = parser.parse_args()
    from loraplex_engine.tracking.mlflow_tracker import MlflowTracker

    silent = socket.socket()  # accepts connections (the kernel's backlog), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    dead = f"http://127.0.0.1:{free_port()}"
    hang = f"http://127.0.0.1:{silent.getsockname()[1]}"
    rows = [
        run("no tracker", [], args.ticks, args.queue),
        run("instant tracker", [Instant()], args.ticks, args.queue),
        run("hung tracker (queue fills)", [Hung()], args.ticks, 1000),
        run("mlflow, nothing listening", [MlflowTracker(dead, "bench")], args.ticks, args.queue),
        run("mlflow, never answers", [MlflowTracker(hang, "bench")], args.ticks, args.queue),
    ]
    silent.close()
    OUT.write_text(json.dumps({"experiments_per_tick": EXPERIMENTS, "rows": rows}, indent=2))
    print(f"wrote {OUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
