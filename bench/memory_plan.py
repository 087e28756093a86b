"""The planner's memory and FLOP table (issues 12 and 17).

    .venv/bin/python bench/memory_plan.py [--out bench/results/memory-plan.json]

One GPU (issue 12): Qwen3-4B and Llama-3.1-8B shapes, 8 and 32 adapters, rank 32 on
every linear (the head too when untied), GRPO 4 prompts x 8 completions per tenant, 256
prompt + 1,024 completion tokens, bf16 base (LoRA and Adam in fp32), gradient
checkpointing off and on, the engine's default 4,096-token micro-batches and 65,536-token
rollout KV budget. Sharded (issue 17): Llama-3.1-70B shapes, the same workload with
checkpointing on, world size 8 with the base sharded by FSDP2 (memory/plan_sharding.py), one
rank's peak against 80 GiB and 141 GB devices.

Each plan runs the engine's own step on fake tensors (loraplex_engine/memory/planner.py) on
the model cut to two depths (``CUTS``), extended linearly to its full depth
(``--cut-layers none`` runs every layer: minutes per row on 2 cores instead of
seconds). The file is rewritten after every row. The targets are checked against the
rows and written with them, met or not.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from loraplex_engine.memory.planner import Workload, load_config, plan

ROOT = Path(__file__).resolve().parent
MODELS = {"Qwen3-4B": "qwen3-4b.json", "Llama-3.1-8B": "llama-3.1-8b.json",
          "Llama-3.1-70B": "llama-3.1-70b.json"}  # fmt: skip
SHARDED = {"Llama-3.1-70B": 8}  # model: world size, base sharded over it
# Depths the plans are measured on and extended from (planner.extrapolate). One GPU: 3
# and 4 layers give the full depth's bytes and FLOPs exactly (Qwen3-4B's 36 layers,
# checked). Sharded: the rollout's peak moves with depth under FSDP (from the first
# decode layer, where FSDP holds the root and a layer twice, to a later moment that
# grows with the KV cache), so 3 and 4 layers miss 2.1 GiB of Llama-3.1-70B's 80;
# 20 and 40 give its 80 layers exactly.
CUTS = {"one": (3, 4), "sharded": (20, 40)}
H100 = 80 * 2**30  # 80 GiB
H200 = 141 * 10**9  # 141 GB


def targets(rows: list[dict]) -> list[dict]:
    """Issue 12's three targets and issue 17's fits, each with its rows and whether met."""
    out = []
    for row in rows:
        d, n, ck = row["detail"], row["adapters"], row["checkpointing"]
        if row["world_size"] > 1:
            out.append({"target": f"{row['model']} x {n} adapters, base sharded over "
                        f"{row['world_size']} GPUs of {d['device_bytes']} bytes: a rank fits",
                        "rank_bytes": row["peak_bytes"]["total"],
                        "met": row["peak_bytes"]["total"] <= d["device_bytes"]})  # fmt: skip
            continue
        if row["model"] != "Qwen3-4B":
            continue
        if n == 32:
            out.append({"target": "Qwen3-4B x 32 adapters trains within 80 GiB",
                        "checkpointing": ck, "train_bytes": d["train_total"],
                        "met": d["train_total"] <= H100})  # fmt: skip
        if n == 8:
            free = 1 - row["peak_bytes"]["total"] / H200
            out.append({"target": "Qwen3-4B x 8 adapters leaves >= 40% of 141 GB free",
                        "checkpointing": ck, "total_bytes": row["peak_bytes"]["total"],
                        "free_fraction": free, "met": free >= 0.4})  # fmt: skip
        if not ck:
            ratio = row["train_flops"] / row["floor_flops"]
            out.append({"target": "training FLOPs within 1.15x of the floor (no checkpointing)",
                        "adapters": n, "ratio": ratio, "met": ratio <= 1.15})  # fmt: skip
    return out


def on_device(row: dict, device_bytes: int) -> dict:
    """``row`` judged against another device: the same plan, its fit fields redone."""
    d = dict(row["detail"], device_bytes=device_bytes)
    d["train_fits"] = d["train_total"] <= device_bytes
    d["train_free_fraction"] = 1 - d["train_total"] / device_bytes
    d["fits"] = row["peak_bytes"]["total"] <= device_bytes
    return dict(row, detail=d)


def workloads(models: list[str], adapters: list[int]) -> list[tuple[str, Workload, list[int]]]:
    """(model, workload, devices to judge it on) of every row, in the table's order."""
    out = []
    for name in models:
        world = SHARDED.get(name, 1)
        for n in adapters:
            for ck in (True,) if world > 1 else (False, True):
                work = Workload(adapters=n, rank=32, checkpointing=ck, world_size=world,
                                shard_base=world > 1)  # fmt: skip
                out.append((name, work, [H100, H200] if world > 1 else [H200]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "results" / "memory-plan.json"))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--adapters", default="8,32")
    p.add_argument("--cut-layers", default="auto",
                   help="two depths, 'none' for every layer, or 'auto' (CUTS)")  # fmt: skip
    p.add_argument("--merge", nargs="+", help="join these result files into --out (no plans run)")
    args = p.parse_args()
    if args.merge:  # e.g. one process per model, run side by side
        rows = [r for f in args.merge for r in json.loads(Path(f).read_text())["rows"]]
        _write(args.out, rows)
        return
    given = None if args.cut_layers in ("none", "auto") else args.cut_layers.split(",")
    rows: list[dict] = []
    adapters = [int(n) for n in args.adapters.split(",")]
    for name, work, devices in workloads(args.models.split(","), adapters):
        config = load_config(ROOT / "configs" / MODELS[name])
        started = time.monotonic()
        print(f"{name} x{work.adapters} checkpointing={work.checkpointing} "
              f"world={work.world_size} ...", flush=True)  # fmt: skip
        cut = CUTS["sharded" if work.shard_base else "one"] if args.cut_layers == "auto" else None
        cut = tuple(int(n) for n in given) if given else cut
        row = plan(config, work, devices[0], name=name, progress=_progress(started),
                   cut_layers=cut)  # fmt: skip
        rows += [on_device(row, device) for device in devices]
        _write(args.out, rows)
    for t in targets(rows):
        print(json.dumps(t))


def _write(out: str, rows: list[dict]) -> None:
    result = {"device_bytes": H200, "rows": rows, "targets": targets(rows)}
    Path(out).write_text(json.dumps(result, indent=1) + "\n")


def _progress(started: float):
    def say(msg: str) -> None:
        print(f"  {msg} [{time.monotonic() - started:.0f}s]", file=sys.stderr, flush=True)

    return say


if __name__ == "__main__":
    main()
