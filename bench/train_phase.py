"""Train phase only: fused vs time-sliced engine ticks at several per-tenant batch sizes.

    .venv/bin/python bench/train_phase.py [--n 8] [--rows 2,4,8,16,32] [--ticks 3]

Two engines in one process (same model, same N experiments as bench/throughput.py), one
``train_mode="fused"`` and one ``"timesliced"``; their ticks alternate (F T T F F T ...)
so machine load hits both alike; the train-phase seconds of each tick are compared
(medians). ``rows`` = completions per experiment per step (group size 4 x prompts).
Prints a table and writes ``--out`` JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="bench")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--rows", default="4,8,16,32")
    p.add_argument("--ticks", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--out", type=Path, default=Path("out/bench/train_phase.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from loraplex_engine.engine import Engine
    from loraplex_engine.spec import parse_spec

    rows_list = [int(x) for x in args.rows.split(",")]
    table = []
    for rows in rows_list:
        targs = throughput.parse_args(
            [f"--preset={args.preset}", "--group=4", f"--prompts={max(1, rows // 4)}"]
        )
        engines = {}
        for mode in ("fused", "timesliced"):
            eng = Engine(
                targs.model_dir,
                max_adapters=args.n,
                max_rank=targs.rank,
                checkpoint_root=tempfile.mkdtemp(prefix="train-phase-"),
                train_mode=mode,
                micro_batch_tokens=args.micro_batch_tokens,
                ignore_eos=True,
            )
            for e in throughput.experiment_specs(args.n, 1000, targs):
                eng.put_experiment(e["id"], parse_spec(e["spec"]), "bench", e["id"][6:])
            eng.tick()  # warm-up
            engines[mode] = eng
        times: dict[str, list[float]] = {"fused": [], "timesliced": []}
        for i in range(args.ticks):
            order = ("fused", "timesliced") if i % 2 == 0 else ("timesliced", "fused")
            for mode in order:
                times[mode].append(engines[mode].tick().phase_seconds["train"])
        fused, sliced = (statistics.median(times[m]) for m in ("fused", "timesliced"))
        tokens = engines["fused"].get_experiment("bench.exp0").train_tokens
        steps = engines["fused"].get_experiment("bench.exp0").step
        row = {
            "n": args.n,
            "rows_per_tenant": 4 * max(1, rows // 4),
            "train_tokens_per_tenant_step": tokens // steps,
            "fused_s": fused,
            "timesliced_s": sliced,
            "timesliced_over_fused": sliced / fused,
            "ticks": times,
        }
        table.append(row)
        print(
            f"N={args.n} rows/tenant {row['rows_per_tenant']:>3}"
            f" tokens/tenant {row['train_tokens_per_tenant_step']:>4}:"
            f" fused {fused:.3f}s time-sliced {sliced:.3f}s ratio {sliced / fused:.2f}",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
