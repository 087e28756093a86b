"""What the version slot cache (versions/slot_cache.py) saves a request for a published
version: latency served from a resident slot vs a load from the version's directory for
every request, on a real ``loraplex-engine serve``. A benchmark, not a test.

    .venv/bin/python bench/version_slots.py [--model-dir DIR] [--requests 60]
        [--out bench/results/version-slots.json]

One engine (torch rollout, 1 thread, ``--max-adapters 3``: one experiment and two spare
slots) and one experiment that publishes three versions (maxSteps 3, everySteps 1) and
is then done, so the engine only serves. Arms, sent one request at a time
(``/v1/completions``, greedy, 4 tokens), alternating cell by cell:

- ``resident``: v1, v2, v1, v2, ...: two versions in two spare slots, each loaded once;
- ``reload``: v1, v2, v3, v1, ...: three versions cycling through two slots, so the LRU
  evicts the one asked for next: every request loads its version (what every request
  cost before the cache).

The server's log counts the loads of each arm (one log line per load).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test helpers, as tests.support

EXP = "bench.versions"
LOAD = re.compile(r"version bench\.versions@v\d+#[0-9a-f]+ loaded into slot \d+ in ([0-9.]+) ms")


def _model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from tests.support.tiny_models import tiny_model

    return tiny_model()


def _start(model_dir: Path, workdir: Path) -> Any:
    from tests.support.server_process import EngineServer
    from tests.support.server_specs import put_body, small_spec

    srv = EngineServer(model_dir, workdir / "ckpt", max_adapters=3, workdir=workdir).start()
    spec = small_spec(max_steps=3, rank=16) | {"publish": {"everySteps": 1, "keep": 10}}
    with srv.client() as api:
        r = api.put(f"/v1/experiments/{EXP}", json=put_body(EXP, spec))
        assert r.status_code == 201, r.text
        deadline = time.monotonic() + 300
        while len(api.get(f"/v1/experiments/{EXP}").json().get("versions") or []) < 3:
            assert time.monotonic() < deadline, "three versions were not published"
            time.sleep(0.5)
    return srv


def _cell(api: httpx.Client, versions: list[str], n: int) -> list[float]:
    seconds = []
    for i in range(n):
        body = {"model": f"{EXP}@{versions[i % len(versions)]}", "prompt": "the answer is",
                "max_tokens": 4, "temperature": 0}  # fmt: skip
        t = time.perf_counter()
        r = api.post("/v1/completions", json=body)
        seconds.append(time.perf_counter() - t)
        assert r.status_code == 200, r.text
    return seconds


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir")
    ap.add_argument("--requests", type=int, default=60, help="per arm, in cells of 10")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "version-slots.json"))
    args = ap.parse_args()
    model_dir = _model_dir(args.model_dir)
    arms = {"resident": ["v1", "v2"], "reload": ["v1", "v2", "v3"]}
    lat: dict[str, list[float]] = {a: [] for a in arms}
    loads = dict.fromkeys(arms, 0)
    load_before = psutil.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        srv = _start(model_dir, Path(tmp))
        try:
            with srv.client() as api:
                for versions in arms.values():  # warm: each version once
                    _cell(api, versions, len(versions))
                for _ in range(max(1, args.requests // 10)):
                    for arm, versions in arms.items():
                        before = len(LOAD.findall(srv.log_text()))
                        lat[arm] += _cell(api, versions, 10)
                        loads[arm] += len(LOAD.findall(srv.log_text())) - before
        finally:
            log_text = srv.log_text()
            srv.stop()
    load_ms = [float(m) for m in LOAD.findall(log_text)]
    result = {
        "model": model_dir.name,
        "machine": platform.node(),
        "cpus": psutil.cpu_count(),
        "load_avg_1m": {"before": load_before, "after": psutil.getloadavg()[0]},
        "arms": {
            arm: {
                "requests": len(xs),
                "loads": loads[arm],
                "p50_ms": 1000 * statistics.median(xs),
                "p90_ms": 1000 * _pct(xs, 0.9),
                "mean_ms": 1000 * statistics.fmean(xs),
            }
            for arm, xs in lat.items()
        },
        "load_ms": {"count": len(load_ms), "p50": statistics.median(load_ms), "max": max(load_ms)},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
