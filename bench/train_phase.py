"""Train phase only: engine ticks of several training arms at several per-tenant batch sizes.

    .venv/bin/python bench/train_phase.py [--n 8] [--rows 2,4,8,16,32] [--ticks 3]
    .venv/bin/python bench/train_phase.py --arms fused-unshared,fused   # prompt sharing

One engine per arm in one process (same model, same N experiments as bench/throughput.py):
``fused`` and ``timesliced`` are the two ``train_mode``s, ``-unshared`` turns shared
prompt prefixes off (``share_prompt_prefix=False``). Their ticks alternate (A B B A A B
...) so machine load hits all alike; the train-phase seconds of each tick are compared
(medians; every arm's ratio is to the first arm). ``rows`` = completions per experiment
per step (``--group`` x prompts). Prints a table and writes ``--out`` JSON.
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
    p.add_argument("--group", type=int, default=4, help="GRPO group size")
    p.add_argument("--arms", default="fused,timesliced", help="first arm is the reference")
    p.add_argument("--out", type=Path, default=Path("out/bench/train_phase.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from loraplex_engine.engine import Engine
    from loraplex_engine.settings.engine import EngineSettings
    from loraplex_engine.spec.experiment import parse_spec

    rows_list = [int(x) for x in args.rows.split(",")]
    arms = args.arms.split(",")
    table = []
    for rows in rows_list:
        prompts = max(1, rows // args.group)
        targs = throughput.parse_args(
            [f"--preset={args.preset}", f"--group={args.group}", f"--prompts={prompts}"]
        )
        engines = {}
        for arm in arms:
            mode, _, unshared = arm.partition("-")
            settings = EngineSettings(
                max_adapters=args.n,
                max_rank=targs.rank,
                checkpoint_root=tempfile.mkdtemp(prefix="train-phase-"),
                train_mode=mode,
                micro_batch_tokens=args.micro_batch_tokens,
            )
            eng = Engine(
                targs.model_dir,
                settings,
                ignore_eos=True,
                share_prompt_prefix=unshared != "unshared",
            )
            for e in throughput.experiment_specs(args.n, 1000, targs):
                eng.put_experiment(e["id"], parse_spec(e["spec"]), "bench", e["id"][6:])
            eng.tick()  # warm-up
            engines[arm] = eng
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for i in range(args.ticks):
            for arm in arms if i % 2 == 0 else arms[::-1]:
                times[arm].append(engines[arm].tick().phase_seconds["train"])
        medians = {arm: statistics.median(times[arm]) for arm in arms}
        first = engines[arms[0]].get_experiment("bench.exp0")
        row = {
            "n": args.n,
            "group": args.group,
            "rows_per_tenant": args.group * prompts,
            "train_tokens_per_tenant_step": first.train_tokens // first.step,
            # Tokens run through the policy forward per tick, all tenants (prompt once
            # when shared); ticks = warm-up + timed.
            "computed_tokens_per_step": {
                arm: engines[arm].computed_train_tokens // (args.ticks + 1) for arm in arms
            },
            **{f"{arm}_s": medians[arm] for arm in arms},
            "over_first": {arm: medians[arm] / medians[arms[0]] for arm in arms},
            "ticks": times,
        }
        if {"fused", "timesliced"} <= set(arms):
            row["timesliced_over_fused"] = medians["timesliced"] / medians["fused"]
        table.append(row)
        print(
            f"N={args.n} rows/tenant {row['rows_per_tenant']:>3}"
            f" tokens/tenant {row['train_tokens_per_tenant_step']:>4}: "
            + " ".join(
                f"{arm} {medians[arm]:.3f}s (x{medians[arm] / medians[arms[0]]:.2f},"
                f" {row['computed_tokens_per_step'][arm]} tok)"
                for arm in arms
            ),
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
