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
wall time (registration and ``--warmup`` rounds excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test helpers, as tests.support
sys.path.insert(0, str(REPO / "bench"))  # its siblings, as the other benchmarks import them

from throughput import machine_info  # noqa: E402


def _model_dir() -> Path:
    from tests.conftest import TINY_MODEL_DIR

    if not (TINY_MODEL_DIR / "config.json").exists():
        from loraplex_engine.dev.tiny_model import build_model

        build_model(TINY_MODEL_DIR)
    return TINY_MODEL_DIR


def _workload(models: int, rounds: int, per_round: int, zipf: float, seed: int) -> list[list[int]]:
    """Each round's models: ``per_round`` Zipf draws over ranks 1..models, deduplicated."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, models + 1) ** zipf
    weights /= weights.sum()
    perm = rng.permutation(models)  # hot tenants anywhere in creation order
    return [
        sorted({int(perm[i]) for i in rng.choice(models, per_round, p=weights)})
        for _ in range(rounds)
    ]


def _arm(name: str, args: argparse.Namespace, plan: list[list[int]]) -> dict[str, Any]:
    from loraplex_engine.spec.training_service import AdamStep, ClientLora, LossCall

    from tests.support.client_driver import drive, sft_datum
    from tests.support.engine_builders import engine

    slots = args.models if name == "resident" else args.slots
    budget = args.spill_budget if name == "spilled" else None
    work = Path(tempfile.mkdtemp(prefix=f"paging-{name}-"))
    eng = engine(
        _model_dir(), work, max_adapters=slots, max_rank=16, max_registered=args.models,
        client_models_per_namespace=args.models, host_adapter_memory=budget,
    )  # fmt: skip
    ce, adam = LossCall("cross_entropy"), AdamStep(learning_rate=0.01)
    data = [sft_datum([1, 40 + i % 50, 41], [100 + i % 60, 101, 102, 103, 104]) for i in range(7)]
    ids = [f"m{i:04d}" for i in range(args.models)]
    t = time.perf_counter()
    for i, model_id in enumerate(ids):
        eng.clients.create_model("bench", model_id, ClientLora(rank=args.rank, seed=i))
    register_s = time.perf_counter() - t
    pager = eng.pager
    page_outs_at_register = pager.stats.page_outs

    def run(members: list[int]) -> None:
        calls = [
            lambda m=m: eng.clients.forward_backward("bench", ids[m], [data[m % 7]], ce)
            for m in members
        ] + [lambda m=m: eng.clients.optim_step("bench", ids[m], adam) for m in members]
        drive(eng, *calls)

    for members in plan[: args.warmup]:  # torch's first calls: not timed
        run(members)
    pager.stats.page_in_seconds.clear()
    page_outs_at_register = pager.stats.page_outs
    ticks = eng._tick.count
    steps, t = 0, time.perf_counter()
    for members in plan[args.warmup :]:
        run(members)
        steps += len(members)
    seconds = time.perf_counter() - t
    ins = sorted(pager.stats.page_in_seconds)
    out = {
        "max_adapters": slots,
        "registered": pager.registered(),
        "register_seconds": register_s,
        "optim_steps": steps,
        "ticks": eng._tick.count - ticks,
        "seconds": seconds,
        "steps_per_s": steps / seconds,
        "page_ins": len(ins),
        "page_outs_during_rounds": pager.stats.page_outs - page_outs_at_register,
        "page_in_ms": {
            "p50": 1000 * statistics.median(ins),
            "p99": 1000 * ins[min(len(ins) - 1, int(0.99 * len(ins)))],
            "max": 1000 * ins[-1],
        }
        if ins
        else None,
        "paged_out_now": len(pager.pages),
        "host_adapter_memory": budget,
        "spilled_now": pager.spilled(),
        "spills_total": pager.stats.spills,
        "paged_host_bytes_now": pager.host_bytes(),
        "host_bytes_per_paged_model": (
            pager.host_bytes() / max(1, len(pager.pages) - pager.spilled())
        ),
    }
    eng.close()
    return out


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
        "--spill-budget", type=int, default=64 << 20, help="the spilled arm's host bytes"
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/paging-cpu-tiny.json")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    plan = _workload(args.models, args.rounds, args.per_round, args.zipf, args.seed)
    start = machine_info()
    arms = {name: _arm(name, args, plan) for name in args.arms.split(",")}
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    result = {
        "bench": "paging",
        "commit": commit,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "distinct_models_per_round": statistics.mean(len(r) for r in plan),
        "distinct_models_touched": len({m for r in plan for m in r}),
        "machine_start": start,
        "loadavg_end": list(os.getloadavg()),
        "torch_threads": 1,
        "arms": arms,
    }
    if "paged" in arms and "resident" in arms:
        paged, resident = arms["paged"]["steps_per_s"], arms["resident"]["steps_per_s"]
        result["paged_over_resident"] = paged / resident
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
