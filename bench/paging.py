"""Adapter paging (memory/paging.py) at a thousand registered models: training throughput
with 8 resident slots vs every model resident, page-in latency, host bytes per paged
model. In process, on the engine's own TrainingService (clients/models.py): the client's
cost (the SDK, HTTP) is not what is measured. A benchmark, not a test.

    .venv/bin/python bench/paging.py [--models 1000] [--slots 8] [--rounds 60]
        [--out bench/results/paging-cpu-tiny.json]

Two arms on the CPU tiny model, one engine each, the same seeded workload:

- ``paged``: ``--max-adapters 8 --max-registered <models>``;
- ``spilled``: ``paged`` with ``--host-adapter-memory`` of ``--spill-budget`` bytes (64
  MiB, about a quarter of what the paged-out models take): the rest are files on the
  checkpoint volume (here a temporary directory on the local disk);
- ``resident``: ``--max-adapters <models>``: every model in a slot, nothing paged.

Each round draws ``--per-round`` models from a Zipf distribution over the registered
ones (exponent ``--zipf``; a few hot tenants, a long tail) and queues one
``forward_backward`` and one ``optim_step`` for each (one SFT datum of 8 tokens), then
ticks until all are answered. Throughput: optimiser steps per second of the rounds'
wall time (registration and ``--warmup`` rounds excluded). ``--working-sets 8,16,32,64``
adds one phase per size on the same engine after the first: the same Zipf draws over only
that many of the registered models (how throughput falls as the hot set outgrows the
slots). Page-in latency is reported per tier (host memory, disk), with the process's
resident memory and the spill files' bytes per registered model.

    # 10,000 models, most on the disk tier; and the working-set curve at 1,000
    .venv/bin/python bench/paging.py --models 10000 --arms spilled --spill-budget 16MiB \
        --working-sets 8 --rounds 33 --out bench/results/paging-10k-cpu-tiny.json
    .venv/bin/python bench/paging.py --models 1000 --arms paged --working-sets 8,16,32,64 \
        --rounds 33 --out bench/results/paging-working-set-cpu-tiny.json

On a GPU (bench/gpu_device.sh's paging stage): ``--device cuda`` (pinned host pages,
``non_blocking`` copies; a page-in's time includes its synchronize), ``--budget-s`` (each
arm gets its share: registration stops at half of it, a phase's rounds at the end; what
ran is recorded) and ``--into KEY`` (the result under KEY of the JSON already at ``--out``).

Prefetch (memory/prefetch.py): ``--models-per-tick N`` caps the client models a tick
takes, so a round's models span ticks and the ones still queued are paged in while the
tick before computes; each phase's ``prefetch`` reports those issued, **hits** (members
a tick found resident because they were prefetched), **misses** (page-ins a tick made
itself) and **wasted** (prefetched, not in the next tick). ``--prefetch-limit 0`` turns
prefetch off (the comparison arm).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test helpers, as tests.support
sys.path.insert(0, str(REPO / "bench"))  # its siblings, as the other benchmarks import them

from loraplex_engine.memory.copy_stream import CopyStats  # noqa: E402
from loraplex_engine.memory.paging import PagingStats  # noqa: E402
from throughput import machine_info  # noqa: E402


def _model_dir() -> Path:
    from tests.support.tiny_models import tiny_model

    return tiny_model()  # the tests' tiny Llama


def _workload(
    models: int, rounds: int, per_round: int, zipf: float, seed: int, among: int | None = None
) -> list[list[int]]:
    """Each round's models: ``per_round`` Zipf draws, deduplicated, over ``among`` of the
    registered models (a working set; None: all of them)."""
    rng = np.random.default_rng(seed)
    n = among or models
    weights = 1.0 / np.arange(1, n + 1) ** zipf
    weights /= weights.sum()
    perm = rng.permutation(models)[:n]  # hot tenants anywhere in creation order
    return [
        sorted({int(perm[i]) for i in rng.choice(n, per_round, p=weights)}) for _ in range(rounds)
    ]


def _percentiles(seconds: list[float]) -> dict[str, float] | None:
    ins = sorted(seconds)
    if not ins:
        return None
    return {
        "n": len(ins),
        "p50": 1000 * statistics.median(ins),
        "p99": 1000 * ins[min(len(ins) - 1, int(0.99 * len(ins)))],
        "max": 1000 * ins[-1],
    }


def _copies(before: CopyStats, now: CopyStats) -> dict[str, Any]:
    """A phase's page-in copies (memory/copy_stream.py): on CUDA, how many had finished
    under earlier work by the time the tick waited on them (hidden) and how many the
    compute stream stalled on (exposed), and their device time; on CPU all are inline."""
    return {
        "issued": now.issued - before.issued,
        "hidden": now.hidden - before.hidden,
        "exposed": now.exposed - before.exposed,
        "copy_ms": _percentiles(now.copy_seconds[len(before.copy_seconds) :]),
    }


def _prefetch(before: PagingStats, now: PagingStats) -> dict[str, int]:
    """A phase's prefetches (memory/prefetch.py): issued during a tick for the next; hits:
    members a tick found resident because they were; misses: page-ins it made itself."""
    return {
        "issued": now.prefetches - before.prefetches,
        "hits": now.prefetch_hits - before.prefetch_hits,
        "misses": now.prefetch_misses - before.prefetch_misses,
        "wasted": now.prefetch_wasted - before.prefetch_wasted,
    }


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _phases(args: argparse.Namespace) -> dict[str, list[list[int]]]:
    """The full Zipf over every registered model, then one per ``--working-sets`` size."""
    common = (args.models, args.rounds, args.per_round, args.zipf, args.seed)
    phases = {"zipf": _workload(*common)}
    for w in args.working_sets:
        phases[f"working_set_{w}"] = _workload(*common, among=w)
    return phases


def _arm(
    name: str, args: argparse.Namespace, phases: dict[str, list[list[int]]], until: float
) -> dict:
    """One engine's run; past ``until`` (monotonic) a phase runs no more rounds, and
    registration stops halfway to it."""
    from loraplex_engine.memory.spill import SpilledPage
    from loraplex_engine.spec.training_service import AdamStep, ClientLora, LossCall

    from tests.support.client_driver import drive, sft_datum
    from tests.support.engine_builders import engine

    slots = args.models if name == "resident" else args.slots
    budget = args.spill_budget if name == "spilled" else None
    work = Path(tempfile.mkdtemp(prefix=f"paging-{name}-"))
    rss_before = _rss()
    eng = engine(
        _model_dir(), work, max_adapters=slots, max_rank=16, max_registered=args.models,
        client_models_per_namespace=args.models, host_adapter_memory=budget,
        device=args.device, client_models_per_tick=args.models_per_tick,
    )  # fmt: skip
    eng.pager.prefetch_limit = args.prefetch_limit
    ce, adam = LossCall("cross_entropy"), AdamStep(learning_rate=0.01)
    data = [sft_datum([1, 40 + i % 50, 41], [100 + i % 60, 101, 102, 103, 104]) for i in range(7)]
    ids = [f"m{i:05d}" for i in range(args.models)]
    rss_engine = _rss()
    t = time.perf_counter()
    halfway = time.monotonic() + (until - time.monotonic()) / 2
    for i, model_id in enumerate(ids):
        if i >= 2 * slots and time.monotonic() > halfway:  # the budget's; draws beyond: cut
            ids = ids[:i]
            break
        eng.clients.create_model("bench", model_id, ClientLora(rank=args.rank, seed=i))
    register_s = time.perf_counter() - t
    phases = {
        k: [kept for r in p if (kept := [m for m in r if m < len(ids)])] for k, p in phases.items()
    }
    pager = eng.pager
    rss_registered = _rss()
    spill_dir = pager.spill_dir.path if pager.spill_dir is not None else None
    disk_bytes = sum(f.stat().st_size for f in spill_dir.iterdir()) if spill_dir else 0
    registered = {
        "register_seconds": register_s,
        "models": len(ids),
        "paged_out": len(pager.pages),
        "spilled": pager.spilled(),
        "page_outs": pager.stats.page_outs,  # none since registering takes no slot
        "never_in_a_slot": pager.fresh(),
        "rss_bytes_per_registered_model": (rss_registered - rss_engine) / args.models,
        "rss_engine_bytes": rss_engine - rss_before,
        "paged_host_bytes": pager.host_bytes(),
        "host_bytes_per_paged_model": pager.host_bytes()
        / max(1, len(pager.pages) - pager.spilled() - pager.fresh()),
        "disk_bytes": disk_bytes,
        "disk_bytes_per_spilled_model": disk_bytes / max(1, pager.spilled()),
        "loadavg": list(os.getloadavg()),
    }
    tiers: dict[str, list[float]] = {"host": [], "disk": []}
    real_page_in = pager.page_in

    def page_in(model: str, wait: bool = True) -> int:  # each page-in's tier and time
        held = pager.pages.get(model)
        before = len(pager.stats.page_in_seconds)
        slot = real_page_in(model, wait)
        if held is not None and len(pager.stats.page_in_seconds) > before:
            tier = "disk" if isinstance(held, SpilledPage) else "host"
            tiers[tier].append(pager.stats.page_in_seconds[-1])
        return slot

    pager.page_in = page_in  # type: ignore[method-assign]

    def run(members: list[int]) -> None:
        calls = [
            lambda m=m: eng.clients.forward_backward("bench", ids[m], [data[m % 7]], ce)
            for m in members
        ] + [lambda m=m: eng.clients.optim_step("bench", ids[m], adam) for m in members]
        drive(eng, *calls)

    out: dict[str, Any] = {"max_adapters": slots, "registered": pager.registered()}
    out["host_adapter_memory"] = budget
    out["registration"] = registered
    out["phases"] = {}
    for label, plan in phases.items():
        for members in plan[: args.warmup]:  # torch's first calls, a set's first pages
            run(members)
        for tier in tiers.values():
            tier.clear()
        page_ins, page_outs, spills, first_slots = (
            pager.stats.page_ins, pager.stats.page_outs, pager.stats.spills,
            pager.stats.first_slots,
        )  # fmt: skip
        copies = replace(pager.copies.stats, copy_seconds=list(pager.copies.stats.copy_seconds))
        fetched = replace(pager.stats)
        ticks = eng._tick.count
        steps, rounds, t = 0, 0, time.perf_counter()
        for members in plan[args.warmup :]:
            if time.monotonic() > until:
                break
            run(members)
            steps += len(members)
            rounds += 1
        seconds = max(time.perf_counter() - t, 1e-9)
        out["phases"][label] = {
            "distinct_models_per_round": statistics.mean(len(r) for r in plan) if plan else 0,
            "distinct_models_touched": len({m for r in plan[args.warmup :] for m in r}),
            "rounds_timed": rounds,
            "optim_steps": steps,
            "ticks": eng._tick.count - ticks,
            "seconds": seconds,
            "steps_per_s": steps / seconds,
            "page_ins": pager.stats.page_ins - page_ins,
            "first_slots": pager.stats.first_slots - first_slots,  # registered, never in one
            "page_outs": pager.stats.page_outs - page_outs,
            "spills": pager.stats.spills - spills,
            "page_in_ms": _percentiles(tiers["host"] + tiers["disk"]),
            "page_in_ms_by_tier": {k: _percentiles(v) for k, v in tiers.items()},
            "copies": _copies(copies, pager.copies.stats),
            "prefetch": _prefetch(fetched, pager.stats),
            "loadavg_after": list(os.getloadavg()),
        }
    out["spilled_now"] = pager.spilled()
    out["spills_total"] = pager.stats.spills
    eng.close()
    shutil.rmtree(work, ignore_errors=True)
    return out


def _bytes(text: str) -> int:
    from loraplex_engine.settings.values import parse_bytes

    return parse_bytes(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=int, default=1000)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--per-round", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3, help="rounds run first, not timed")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default="paged,spilled,resident")
    ap.add_argument(
        "--spill-budget", type=_bytes, default=64 << 20, help="the spilled arm's host bytes"
    )
    ap.add_argument(
        "--working-sets", default="", help="comma-separated sizes: a Zipf phase over each"
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/paging-cpu-tiny.json")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models-per-tick", type=int, default=None,
                    help="client models a tick takes (the rest are prefetched)")  # fmt: skip
    ap.add_argument("--prefetch-limit", type=int, default=None,
                    help="page-ins prefetched a tick (default: the slots; 0: off)")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=None, help="seconds, all arms together")
    ap.add_argument("--into", default=None, metavar="KEY",
                    help="write under KEY of the JSON object already at --out")  # fmt: skip
    args = ap.parse_args()
    args.working_sets = [int(w) for w in args.working_sets.split(",") if w]
    import torch

    torch.set_num_threads(1)
    phases = _phases(args)
    start = machine_info()
    names = args.arms.split(",")
    _model_dir()  # the model built and the engine imported before the budget's clock starts
    import tests.support.engine_builders  # noqa: F401

    end = time.monotonic() + (args.budget_s or float("inf"))
    arms = {}
    for i, n in enumerate(names):  # each arm an equal share of what is left
        arms[n] = _arm(
            n, args, phases, time.monotonic() + (end - time.monotonic()) / (len(names) - i)
        )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    result = {
        "bench": "paging",
        "commit": commit,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine_start": start,
        "loadavg_end": list(os.getloadavg()),
        "torch_threads": 1,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "arms": arms,
    }
    if "paged" in arms and "resident" in arms:
        paged = arms["paged"]["phases"]["zipf"]["steps_per_s"]
        resident = arms["resident"]["phases"]["zipf"]["steps_per_s"]
        result["paged_over_resident"] = paged / resident
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.into:
        whole = json.loads(args.out.read_text()) if args.out.exists() else {}
        result = {**whole, args.into: result}
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
