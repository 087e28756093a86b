"""Placement benchmark: 2,000 experiments onto 250 engines (mixed ranks and slots).

Reports decision time and packing efficiency against lower bounds:

- slots bound: fewest engines whose slots (largest first) hold all bound experiments;
- rank bound: the same, counted only over engines whose max rank can host the
  experiments above each rank threshold (the largest over thresholds);
- memory bound: fewest engines whose budgets (largest first) hold the bound memory.

Scenarios: everything pending at once (one round), with each best-fit order; arrivals in
batches of 50 (40 rounds, engines carry what earlier rounds bound); and the same 2,000
onto 250 uniform engines (8 slots, max rank 128: one pool template) at three-quarters
load (1,500 experiments), where the slots bound is simply ceil(1500 / 8) = 188.

    .venv/bin/python bench/placement_bench.py [--experiments 2000] [--engines 250] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace

from loraplex_operator.placement import (
    RANK_FIRST,
    SLOTS_FIRST,
    Bind,
    Engine,
    FitOrder,
    ModelShape,
    PendingExperiment,
    PoolLimits,
    RunningExperiment,
    adapter_memory_bytes,
    plan,
)

QWEN3_4B = ModelShape(num_layers=36, hidden_size=2560, intermediate_size=9728, kv_dim=1024)
RANKS = [(8, 0.40), (16, 0.30), (32, 0.15), (64, 0.10), (128, 0.05)]
MODULE_SETS = [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"]]
ENGINE_KINDS = [(4, 128), (8, 64), (16, 32), (8, 128), (16, 64)]  # (slots, max rank)
MEMORY_BUDGET = 6 * 2**30


def make_engines(n: int, rng: random.Random) -> list[Engine]:
    engines = []
    for i in range(n):
        slots, max_rank = rng.choice(ENGINE_KINDS)
        engines.append(
            Engine(f"engine-{i:04d}", True, slots, 0, max_rank, memory_budget=MEMORY_BUDGET)
        )
    return engines


def make_experiments(n: int, rng: random.Random) -> list[PendingExperiment]:
    ranks, weights = zip(*RANKS, strict=True)
    out = []
    for i in range(n):
        rank = rng.choices(ranks, weights)[0]
        memory = adapter_memory_bytes(rank, rng.choice(MODULE_SETS), QWEN3_4B)
        out.append(PendingExperiment(f"ns/x{i:05d}", rng.randint(0, 3), float(i), rank, memory))
    return out


def _engines_for(demand: float, capacities: list[float]) -> int:
    total, count = 0.0, 0
    for cap in sorted(capacities, reverse=True):
        if total >= demand:
            break
        total += cap
        count += 1
    return count if total >= demand else len(capacities) + 1


def lower_bound(bound: list[PendingExperiment], engines: list[Engine]) -> dict[str, int]:
    slots = _engines_for(len(bound), [e.slots_total for e in engines])
    rank = max(
        _engines_for(
            sum(1 for x in bound if x.rank > t), [e.slots_total for e in engines if e.max_rank > t]
        )
        for t in (0, 32, 64)
    )
    memory = _engines_for(sum(x.memory_bytes for x in bound), [e.memory_budget for e in engines])
    return {"slots": slots, "rank": rank, "memory": memory, "best": max(slots, rank, memory)}


def _report(name: str, seconds: float, bound, engines, used: set[str], rounds: int) -> dict:
    lb = lower_bound(bound, engines)
    used_slots = sum(e.slots_total for e in engines if e.name in used)
    return {
        "scenario": name,
        "rounds": rounds,
        "decision_seconds": round(seconds, 4),
        "bound": len(bound),
        "engines_used": len(used),
        "lower_bound": lb,
        "efficiency": round(lb["best"] / max(len(used), 1), 3),
        "slot_fill_of_used_engines": round(len(bound) / max(used_slots, 1), 3),
    }


def one_round(experiments, engines, order: FitOrder = RANK_FIRST) -> dict:
    limits = PoolLimits(len(engines), len(engines), 8, 128, MEMORY_BUDGET)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        decisions = plan(experiments, engines, limits, order)
        best = min(best, time.perf_counter() - t0)
    binds = [d for d in decisions if isinstance(d, Bind)]
    by_key = {x.key: x for x in experiments}
    bound = [by_key[b.experiment] for b in binds]
    return _report(f"all-at-once/{order}", best, bound, engines, {b.engine for b in binds}, 1)


def batched(experiments, engines, batch: int) -> dict:
    limits = PoolLimits(len(engines), len(engines), 8, 128, MEMORY_BUDGET)
    state = {e.name: e for e in engines}
    waiting: list[PendingExperiment] = []
    bound: list[PendingExperiment] = []
    elapsed, rounds = 0.0, 0
    for start in range(0, len(experiments), batch):
        waiting += experiments[start : start + batch]
        t0 = time.perf_counter()
        decisions = plan(waiting, state.values(), limits)
        elapsed += time.perf_counter() - t0
        rounds += 1
        by_key = {x.key: x for x in waiting}
        for d in decisions:
            if isinstance(d, Bind):
                x = by_key.pop(d.experiment)
                e = state[d.engine]
                run = RunningExperiment(x.key, x.priority, x.rank, x.memory_bytes, x.created)
                state[d.engine] = replace(
                    e,
                    slots_used=e.slots_used + 1,
                    memory_used=e.memory_used + x.memory_bytes,
                    running=(*e.running, run),
                )
                bound.append(x)
        waiting = list(by_key.values())
    used = {e.name for e in state.values() if e.slots_used}
    return _report(f"batches-of-{batch}", elapsed, bound, engines, used, rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiments", type=int, default=2000)
    ap.add_argument("--engines", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    engines = make_engines(args.engines, rng)
    experiments = make_experiments(args.experiments, rng)
    print(
        json.dumps(
            {
                "experiments": len(experiments),
                "engines": len(engines),
                "total_slots": sum(e.slots_total for e in engines),
            }
        )
    )
    uniform = [replace(e, slots_total=8, max_rank=128) for e in engines]
    results = [
        one_round(experiments, engines, RANK_FIRST),
        one_round(experiments, engines, SLOTS_FIRST),
        batched(experiments, engines, 50),
        {
            **one_round(experiments[: len(experiments) * 3 // 4], uniform),
            "scenario": "uniform-8-slot-engines/three-quarters-load",
        },
    ]
    for result in results:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
