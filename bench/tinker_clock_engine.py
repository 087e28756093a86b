"""bench/tinker_clock.py's ``engine_only``: the same data as its SDK clients' on an
in-process Engine, no HTTP and no SDK, all models' calls queued before one tick (fused)
or one model's a tick (per_model). Its tick seconds are what the engine alone costs, so
its ratio is the ceiling of the HTTP arms' on that machine for that batch size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

RANK = 8  # every client's LoRA rank
SEED0 = 1000  # client i's seed and data generator: SEED0 + i


class _Ticks:
    """The engine as client_driver.drive sees it, summing its ticks' own seconds."""

    def __init__(self, eng: Any) -> None:
        self.eng, self.clients, self.seconds, self.count = eng, eng.clients, 0.0, 0

    def tick(self) -> Any:
        report = self.eng.tick()
        if report is not None:
            self.seconds += report.seconds
            self.count += 1
        return report


def engine_only(model: Path, work: Path, rows: int, n: int, args) -> dict:
    """No HTTP, no SDK: the same data on an in-process Engine (torch at --threads),
    each step's forward_backward + optim_step of all n models queued before one tick
    (fused) or one model's per tick (per_model). The tick seconds are what the engine
    alone costs: the ratio's ceiling on this machine for this batch size."""
    import torch
    from loraplex_engine.spec.training_service import AdamStep, ClientLora, LossCall

    from tests.support.client_driver import drive, sft_datum
    from tests.support.engine_builders import engine

    torch.set_num_threads(args.threads)
    # Every call is queued before its tick here: nothing is on its way to gather. One
    # namespace holds all n models: the ceiling measures the engine, not a tenant's share.
    eng = engine(
        model, work / f"inproc-{rows}-{n}", max_adapters=n, max_rank=16, client_tick_gather=0,
        client_models_per_namespace=n, device=args.device,
    )  # fmt: skip
    ce, adam = LossCall("cross_entropy"), AdamStep(learning_rate=args.lr)
    data = {}
    for i in range(n):
        rng = np.random.default_rng(SEED0 + i)
        split = args.prompt_tokens
        seqs = [
            rng.integers(3, args.vocab, split + args.completion_tokens).tolist()
            for _ in range(rows)
        ]
        data[f"m{i}"] = [sft_datum(q[:split], q[split:]) for q in seqs]
        eng.clients.create_model("bench", f"m{i}", ClientLora(rank=RANK, seed=SEED0 + i))
    ticks = _Ticks(eng)

    def step(models: list[str]) -> None:
        calls = []
        for m in models:
            calls.append(lambda m=m: eng.clients.forward_backward("bench", m, data[m], ce))
            calls.append(lambda m=m: eng.clients.optim_step("bench", m, adam))
        drive(ticks, *calls)

    out = {}
    try:
        step(list(data))  # warm
        for arm in ("fused", "per_model", "fused", "per_model"):
            ticks.seconds, ticks.count = 0.0, 0
            for _ in range(args.steps):
                for group in [list(data)] if arm == "fused" else [[m] for m in data]:
                    step(group)
            out.setdefault(arm, []).append(round(ticks.seconds, 4))
    finally:
        eng.close()
    best = {arm: min(v) for arm, v in out.items()}
    return {"rows": rows, "n": n, "tick_s": out,
            "ratio": round(best["per_model"] / best["fused"], 3)}  # fmt: skip
