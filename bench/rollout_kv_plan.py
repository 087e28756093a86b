#!/usr/bin/env python3
"""The planner's rollout phase alone (no training step): the torch rollout's KV cache and
everything it allocates, under a KV-token budget and unbounded, for 8 and 32 tenants.

    python bench/rollout_kv_plan.py [--config bench/configs/qwen3-4b.json]

Runs ``planner._rollout`` on the model, slots and rows ``plan`` builds (fake tensors,
``memtrack.LiveBytes``); a few minutes per row on 2 shared cores.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from loraplex_engine.memory import planner
from loraplex_engine.memory.fake_model import keep_index_values
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent


def rollout_row(config, adapters: int, budget: int) -> dict:
    work = planner.Workload(adapters=adapters, rank=32, rollout_kv_tokens=budget)
    tracker = planner.LiveBytes(fake_scalars=True)
    with keep_index_values(), FakeTensorMode(allow_non_fake_inputs=True), tracker:
        base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        model, _ = planner._adapters(base, work)
        before = tracker.live
        with tracker.in_phase("rollout"):
            kv = planner._rollout(model, work)
    allocated = tracker.peaks["rollout"].bytes - before + kv["final"] - kv["measured"]
    return {"adapters": adapters, "rollout_kv_tokens": budget, "rows": kv["rows"],
            "micro_batches": kv["micro_batches"], "kv_cache_gib": kv["final"] / 2**30,
            "rollout_allocated_gib": allocated / 2**30}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default=str(ROOT / "configs" / "qwen3-4b.json"))
    p.add_argument("--budget", type=int, default=planner.DEFAULT_ROLLOUT_KV_TOKENS)
    args = p.parse_args()
    config = planner.load_config(args.config)
    for adapters in (8, 32):
        for budget in (args.budget, 10**9):
            started = time.monotonic()
            row = rollout_row(config, adapters, budget)
            print({**row, "seconds": round(time.monotonic() - started)}, flush=True)


if __name__ == "__main__":
    main()
