"""Leaving the data-parallel group (distributed.leave): nothing of the group outlives it.

Rank 1 of `run --world-size 2 --shard-base` aborted now and then at exit ("terminate
called without an active exception", SIGABRT) because its gloo group was still alive at
interpreter teardown: a sharded base (FSDP2) holds the group through its DeviceMesh,
which DTensor's sharding-propagation caches keep after the model is dropped, so
``destroy_process_group`` alone left gloo's threads running. A real gloo group of one
rank in this process, a real FSDP2 model.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from loraplex_engine.parallel import distributed
from loraplex_engine.parallel.distributed import World
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def _join_one_rank() -> None:
    store = dist.TCPStore(distributed.LOOPBACK, 0, 1, is_master=True, timeout=timedelta(seconds=30))
    distributed.join(World(0, 1), torch.device("cpu"), 30.0, store)


def _train_a_sharded_model() -> None:
    """What a rank's engine does under --shard-base, then drops it (as the runner does)."""
    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(2, 8)).sum().backward()


def test_destroy_alone_leaves_a_sharded_models_group_running_release_ends_it() -> None:
    before = distributed.group_threads()
    _join_one_rank()
    _train_a_sharded_model()
    assert len(distributed.group_threads()) == len(before) + 3  # 2 workers + the TCP loop
    dist.destroy_process_group()
    # The cause: the dropped model's DTensors, cached by DTensor, still hold the group.
    assert len(distributed.group_threads()) == len(before) + 3
    assert distributed.release_group() == before


def test_leave_joins_the_groups_threads_after_a_sharded_base() -> None:
    before = distributed.group_threads()
    _join_one_rank()
    _train_a_sharded_model()
    distributed.leave()  # barrier, destroy, release
    assert not dist.is_initialized()
    assert distributed.group_threads() == before
