"""API requests per minute the operator makes, at rest and during a burst of creates.

    python bench/operator_requests.py --pools 50 --experiments 1000 \
        --out bench/results/operator-requests.json --label after

The test API server of the operator harness (kmock, `tests/support/harness.py`) records
every request; requests whose User-Agent is kopf's or the operator's are counted. The
operator runs as the chart renders it (`tests/support/deployed.py`), with the chart's
defaults (a round every 5 s).

No engines run: 1,000 real engines cannot run on a laptop. Each pool allows one engine
(`replicas` 0..1) and no kubelet starts it, so every pool has one Pending engine Pod and
its experiments wait `Pending` (capacity not yet available). The API traffic is the one
a pool with engines makes minus the engine polling (which goes to the engines, not the
API server) and minus progress-status writes.

Phases: start the operator on `--pools` empty pools; **burst**: create
`--experiments` experiments spread over the pools as fast as the API server takes them,
counting the operator's requests in the `--window` seconds from the first create; wait
until every experiment has a status; **rest**: count the operator's requests in the next
`--window` seconds.

`--before REF` runs the operator code of git ref REF (its `operator/` package, extracted
to a temporary directory and put first on the operator's PYTHONPATH) with this bench and
chart: `--before b5474a5^` is the operator that listed pools, experiments and Pods every
round, before it read kopf's indexes.

The operator runs in its own process group, killed when the bench ends, however it ends
(SIGTERM and SIGHUP end the bench through its cleanup; `tests/support/child_processes.py` kills
what is left at exit). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import kmock
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test helpers, as tests.support
from tests.support import harness  # noqa: E402
from tests.support.deployed import OperatorProcess, chart_values, rendered_operator  # noqa: E402
from tests.support.harness import (  # noqa: E402
    ENGINE_NS,
    OPERATOR_AGENTS,
    TOKEN_SECRET,
    ApiServer,
    Harness,
    _kubeconfig,
    declare_resources,
)

GROUP_PATH = "/apis/loraplex.dev/v1alpha1"


def check_each_spec_once() -> None:
    """The burst creates 1,000 copies of one spec: the API server stand-in checks schema
    and CEL once per distinct spec (a check costs ~0.2 s of CPU in the process that also
    serves the operator), not once per create."""
    admit = harness.admit
    seen: dict[str, list[str]] = {}

    def cached(kind: str, obj: dict[str, Any], *old: Any) -> list[str]:
        if old:
            return admit(kind, obj, *old)
        key = kind + json.dumps(obj.get("spec"), sort_keys=True)
        if key not in seen:
            seen[key] = admit(kind, obj)
        return seen[key]

    harness.admit = cached


def operator_requests(api: kmock.KubernetesEmulator) -> list[Any]:
    out = []
    for req in list(api):
        agent = next((v for k, v in req.headers.items() if k.lower() == "user-agent"), "")
        if agent.startswith(OPERATOR_AGENTS):
            out.append(req)
    return out


def by_kind(requests: list[Any]) -> dict[str, int]:
    """'VERB resource' -> count (watches are long-lived: one per stream)."""
    kinds: Counter[str] = Counter()
    for req in requests:
        what = req.resource.plural if req.resource is not None else "discovery"
        verb = req.action.value if req.action is not None else req.method.value
        kinds[f"{verb} {what}"] += 1
    return dict(sorted(kinds.items()))


async def count_window(api: kmock.KubernetesEmulator, seconds: float) -> dict[str, Any]:
    before = len(operator_requests(api))
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    after = operator_requests(api)
    window = after[before:]
    elapsed = time.monotonic() - t0
    return {
        "seconds": round(elapsed, 1),
        "requests": len(window),
        "per_minute": round(len(window) * 60.0 / elapsed, 1),
        "by_kind": by_kind(window),
    }


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def checkout_operator(ref: str, into: Path) -> Path:
    """The `operator/` directory of git ref `ref`, extracted under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, "operator"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "operator"


def end_on_signals() -> None:
    """SIGTERM/SIGHUP (a `timeout`, a closed terminal) end the bench as Ctrl-C does, so
    the `finally` that stops the operator runs; Python's default would skip it."""

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)


async def create_all(
    http: httpx.AsyncClient, objs: list[tuple[str, dict[str, Any]]], what: str = ""
) -> None:
    gate = asyncio.Semaphore(16)
    done = 0

    async def one(path: str, obj: dict[str, Any]) -> None:
        async with gate:
            for _ in range(5):  # a busy server may drop a connection: create again
                try:
                    r = await http.post(path, json=obj)
                except httpx.TransportError:
                    continue
                if r.status_code != 409:  # 409: the dropped attempt had created it
                    r.raise_for_status()
                nonlocal done
                done += 1
                if what and (done % 100 == 0 or done == len(objs)):
                    progress(f"created {done}/{len(objs)} {what}")
                return
            raise RuntimeError(f"could not create {obj['metadata']['name']}")

    await asyncio.gather(*(one(p, o) for p, o in objs))


async def with_status(http: httpx.AsyncClient) -> tuple[int, int]:
    """(experiments, experiments with a status phase)."""
    r = await http.get(f"{GROUP_PATH}/loraexperiments")
    items = r.json().get("items", [])
    return len(items), sum(1 for i in items if (i.get("status") or {}).get("phase"))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="operator-requests-"))
    check_each_spec_once()
    api = ApiServer()
    declare_resources(api)
    async with api, kmock.Server(api) as server:
        url = str(server.url).rstrip("/")
        kubeconfig = workdir / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(_kubeconfig(url)))
        # No timeout: a saturated API server answers late, the bench waits.
        http = httpx.AsyncClient(base_url=url, headers={"User-Agent": "bench"}, timeout=None)
        secret = {"metadata": {"name": TOKEN_SECRET, "namespace": ENGINE_NS}}
        secret["stringData"] = {"token": "bench-token"}
        await http.post(f"/api/v1/namespaces/{ENGINE_NS}/secrets", json=secret)
        pools = [f"pool-{i:02d}" for i in range(args.pools)]
        objs = Harness(workdir, workdir)
        pool_objs = [objs.pool_obj(p, slots=4, replicas=(0, 1)) for p in pools]
        await create_all(http, [(f"{GROUP_PATH}/enginepools", obj) for obj in pool_objs], "pools")
        # The operator as the chart renders it, with the chart's default settings.
        operator = OperatorProcess(rendered_operator(chart_values(None, None)), kubeconfig, workdir)
        if args.before:
            code = checkout_operator(args.before, workdir / "before")
            path = os.environ.get("PYTHONPATH", "")
            os.environ["PYTHONPATH"] = os.pathsep.join([str(code), path])
        operator.start()
        progress(f"operator pid {operator.proc.pid if operator.proc else '?'}, log in {workdir}")
        try:
            await asyncio.sleep(args.settle)  # kopf up, one daemon per pool running
            idle = await count_window(api, args.window / 2)
            exps = []
            for i in range(args.experiments):
                obj = Harness.experiment_obj(f"exp-{i:04d}", pools[i % len(pools)])
                exps.append((f"{GROUP_PATH}/namespaces/team-a/loraexperiments", obj))
            burst_task = asyncio.create_task(count_window(api, args.window))
            t0 = time.monotonic()
            await create_all(http, exps, "experiments")
            created_s = time.monotonic() - t0
            burst = await burst_task
            settled_s: float | None = None
            deadline = time.monotonic() + args.settle_timeout
            while time.monotonic() < deadline:
                if operator.proc is None or operator.proc.poll() is not None:
                    raise SystemExit(f"operator exited:\n{operator.log_text()[-3000:]}")
                total, settled = await with_status(http)
                if total >= args.experiments and settled == total:
                    settled_s = time.monotonic() - t0
                    progress(f"all {total} experiments have a status after {settled_s:.0f} s")
                    break
                progress(f"{settled}/{total} experiments have a status")
                await asyncio.sleep(5.0)
            progress("counting the rest window")
            await asyncio.sleep(args.settle)
            rest = await count_window(api, args.window)
        finally:
            operator.stop()
            await http.aclose()
    return {
        "label": args.label,
        "command": args.command,
        "operator_code": f"git {args.before}" if args.before else "this checkout",
        "pools": args.pools,
        "experiments": args.experiments,
        "engines": "none (replicas 0..1, Pods stay Pending: no kubelet)",
        "reconcile_interval_s": 5.0,
        "empty_pools": idle,
        "burst": {**burst, "create_seconds": round(created_s, 1)},
        # None: not every experiment had a status within --settle-timeout
        "all_statuses_after_s": None if settled_s is None else round(settled_s, 1),
        "operator_errors_logged": operator.log_text().count("Traceback"),
        "rest": rest,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pools", type=int, default=50)
    p.add_argument("--experiments", type=int, default=1000)
    p.add_argument("--window", type=float, default=60.0, help="seconds per measurement")
    p.add_argument("--settle", type=float, default=15.0)
    p.add_argument("--settle-timeout", type=float, default=300.0)
    p.add_argument("--label", default="current")
    p.add_argument("--command", default="", help="recorded with the result")
    p.add_argument("--out", type=Path, default=None, help="JSON file (runs keyed by --label)")
    p.add_argument("--before", metavar="REF", default="", help="run the operator of git REF")
    args = p.parse_args()
    end_on_signals()
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    if args.out is not None:
        runs = json.loads(args.out.read_text()) if args.out.exists() else {}
        runs[args.label] = result
        args.out.write_text(json.dumps(runs, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
