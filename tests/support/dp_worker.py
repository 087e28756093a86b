"""One rank of the two-process gloo tests in test_data_parallel.py (torch.multiprocessing
spawns it: a module of its own, so the child imports nothing but torch and this)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from loraplex_engine.parallel import distributed
from loraplex_engine.parallel.distributed import World

SHAPES = [(4, 3, 5), (4, 2, 7), (4, 6), (4, 3, 5)]
SLOTS = slice(1, 3)


def rank_grads(rank: int) -> list[torch.Tensor | None]:
    """Rank ``rank``'s local gradients: p0 on both ranks, p1 on rank 1 only, p2 on none,
    p3 random per rank."""
    g = torch.Generator().manual_seed(rank)
    return [
        torch.full(SHAPES[0], float(rank + 1)),
        torch.randn(SHAPES[1], generator=g) if rank == 1 else None,
        None,
        torch.randn(SHAPES[3], generator=g),
    ]


def run_rank(rank: int, port: int, out: str) -> None:
    """Join by env:// (rank 0 serves the store, as under torchrun), all-reduce with 64-byte buckets
    (several per tensor list), broadcast tensors and an object; save what came out."""
    os.environ.update(MASTER_ADDR=distributed.LOOPBACK, MASTER_PORT=str(port))
    torch.set_num_threads(1)
    distributed.join(World(rank, 2), torch.device("cpu"), timeout_s=60)
    try:
        params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
        for p, grad in zip(params, rank_grads(rank), strict=True):
            p.grad = None if grad is None else grad.clone()
        distributed.all_reduce_lora_grads(params, SLOTS, bucket_bytes=64)
        # a whole tensor, and a strided view (a slot's lora_B block) written in place
        whole = torch.arange(5.0) * (rank + 1)
        stacked = torch.zeros(4, 4)
        stacked[:, 1:3] = 7.0 if rank == 0 else -1.0
        distributed.broadcast_tensors([whole, stacked[:, 1:3]])
        obj = distributed.broadcast_object({"from": rank} if rank == 0 else None)
        torch.save(
            {"grads": [p.grad for p in params], "whole": whole, "stacked": stacked, "obj": obj},
            Path(out) / f"rank{rank}.pt",
        )
    finally:
        distributed.leave()


# ---- a data-parallel update with off-policy correction --------------------------------

TIS_LR = 0.01


def tis_trainer(model_dir: str, world: World | None):
    """The tiny model with adapters a, b, c; their trainer, recomputing the old log-probs
    as under a vLLM rollout (the rows' log-probs are then the sampler's)."""
    from loraplex_engine.parallel.data_parallel import DataParallelTraining
    from loraplex_engine.train.optim import AdamWSettings, PerAdapterAdamW
    from loraplex_engine.train.strategy import FusedTraining

    from tests.support.lora_helpers import CONFIGS, multi_model

    model = multi_model(Path(model_dir))
    optimizer = PerAdapterAdamW(model)
    for name in CONFIGS:
        optimizer.add_adapter(name, AdamWSettings(lr=TIS_LR))
    kw = {"recompute_old_logprobs": True}
    if world is None:
        return FusedTraining(model, optimizer, torch.device("cpu"), 0, 64, None, **kw)
    return DataParallelTraining(
        model, optimizer, torch.device("cpu"), 0, 64, None, world=world, **kw
    )


def tis_rows(model):
    """Every adapter's rows, sampler log-probs in [-6, -4] (the trainer's are ~-5.5): TIS
    weights spread over (0.2, cap], a different one per token."""
    from tests.support.lora_helpers import CONFIGS, random_tick_rows

    return random_tick_rows(model, CONFIGS, (4, 3, 2, 3), max_prompt=9, max_done=6)


def tis_losses(tis_cap: float | None):
    from loraplex_engine.train.algorithms import ClippedRatioLoss

    from tests.support.lora_helpers import CONFIGS

    return {n: ClippedRatioLoss(kl_coef=0.1 if n == "b" else 0.0, tis_cap=tis_cap) for n in CONFIGS}


def train_with_tis(
    trainer, tis_cap: float | None
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, tuple[float | None, int]]]:
    """One update of every adapter; their weights after it, and each one's TIS statistic
    (its mean weight and the tokens weighted: TrainOutcome's, over every rank's rows)."""
    from tests.support.lora_helpers import CONFIGS

    rows = tis_rows(trainer.model)
    outcomes = trainer.train(rows, tis_losses(tis_cap))
    assert all(o.failure is None for o in outcomes.values()), outcomes
    tis = {n: (o.tis_weight_mean, o.tis_tokens) for n, o in outcomes.items()}
    return {n: trainer.model.adapter_state_dict(n) for n in CONFIGS}, tis


def tis_tokens_of(model) -> dict[str, int]:
    """Each adapter's completion tokens in ``tis_rows``: what TIS must weight."""
    counts: dict[str, int] = {}
    for row in tis_rows(model):
        counts[row.experiment] = counts.get(row.experiment, 0) + len(row.completion_ids)
    return counts


def run_tis_rank(rank: int, port: int, model_dir: str, out: str, tis_cap: float) -> None:
    """Rank 0 drives one update with TIS over two ranks (rank 1 follows its messages);
    each saves its adapters after it."""
    os.environ.update(MASTER_ADDR=distributed.LOOPBACK, MASTER_PORT=str(port))
    torch.set_num_threads(1)
    world = World(rank, 2)
    distributed.join(world, torch.device("cpu"), timeout_s=120)
    try:
        trainer = tis_trainer(model_dir, world)
        tis = None
        if world.is_leader:
            adapters, tis = train_with_tis(trainer, tis_cap)
            trainer.stop()
        else:
            assert trainer.follow() == 1
            adapters = {n: trainer.model.adapter_state_dict(n) for n in tis_losses(None)}
        torch.save({"adapters": adapters, "tis": tis}, Path(out) / f"tis-rank{rank}.pt")
    finally:
        distributed.leave()
