"""One rank of the two-process gloo tests in test_data_parallel.py (torch.multiprocessing
spawns it: a module of its own, so the child imports nothing but torch and this)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from loraplex_engine import distributed
from loraplex_engine.distributed import World

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
