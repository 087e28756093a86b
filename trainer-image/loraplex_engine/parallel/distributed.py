"""torch.distributed for data parallelism: the process group, the LoRA-gradient
all-reduce and object broadcasts (parallel/data_parallel.py decides what goes through them).

One pod, N ranks: gloo on the CPU, NCCL on CUDA. Rendezvous is torchrun's env://
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); the local launcher
(parallel/launch.py) serves the store itself on loopback, on a port the OS picks. Every
collective has the group's timeout, so a rank that dies or stalls fails the others
with an error instead of a hang.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from loraplex_engine.settings.engine import DEFAULT_DIST_TIMEOUT_S
from loraplex_engine.spec.errors import UsageError

log = logging.getLogger("loraplex_engine.parallel.distributed")

LOOPBACK = "127.0.0.1"
# How long a collective waits for every rank: a worker waits for rank 0's next tick
# through a whole rollout and reward phase, so this bounds a tick, not a message.
DEFAULT_TIMEOUT_S = DEFAULT_DIST_TIMEOUT_S  # --dist-timeout's default
# Gradient bucket size: DDP's default (25 MiB); one all-reduce per bucket.
BUCKET_BYTES = 25 * 2**20
JOINED_KEY = "loraplex/joined/{rank}"  # a worker's check-in, before the group forms
ENV_STORE_PREFIX = "default_pg"
# The native threads of a live gloo group (ProcessGroupGloo's two workers, gloo's TCP
# event loop), by the names torch and gloo give them.
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


@dataclass(frozen=True)
class World:
    """This process's place in the data-parallel group."""

    rank: int
    size: int

    @property
    def is_leader(self) -> bool:
        """Rank 0: serves the API, runs the tick's rollout, writes checkpoints."""
        return self.rank == 0


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def device_for_rank(requested: str, world_size: int, local_rank: int, cuda_count: int) -> str:
    """This rank's torch device for ``--device`` (auto, cpu, cuda or cuda:N; parsed by
    settings/engine.py): ``auto`` is cuda where torch sees a GPU, else cpu; over N > 1 ranks,
    ``cuda`` is ``cuda:<LOCAL_RANK>``, one GPU per rank (NCCL refuses two ranks on one
    GPU, so ``cuda:N`` with several ranks is refused). ``UsageError`` names a device this
    machine does not have."""
    device = ("cuda" if cuda_count > 0 else "cpu") if requested == "auto" else requested
    if device == "cpu":
        return device
    if cuda_count < 1:
        raise UsageError(f"--device {requested}: torch sees no CUDA device here")
    if device != "cuda":  # cuda:N
        if world_size > 1:
            raise UsageError(
                f"--device {device} puts every rank on one GPU: --world-size {world_size} "
                "needs --device cuda (rank r on cuda:<LOCAL_RANK>)"
            )
        if int(device.split(":", 1)[1]) >= cuda_count:
            raise UsageError(f"--device {device}: torch sees {cuda_count} CUDA device(s)")
        return device
    if world_size == 1:
        return device
    if world_size > cuda_count:
        raise UsageError(
            f"--world-size {world_size} on cuda needs a GPU per rank; torch sees {cuda_count}"
        )
    return f"cuda:{local_rank}"


def local_rank(env: Mapping[str, str] | None = None) -> int:
    """``LOCAL_RANK`` (torchrun's, or dp_launch's), else ``RANK``, else 0 (rank 0 of a
    group it starts itself)."""
    env = os.environ if env is None else env
    for name in ("LOCAL_RANK", "RANK"):
        if env.get(name, "").strip():
            return int(env[name])
    return 0


def world_from_env(env: Mapping[str, str] | None = None) -> World | None:
    """``RANK`` and ``WORLD_SIZE`` as torchrun sets them; None when ``RANK`` is unset."""
    env = os.environ if env is None else env
    if "RANK" not in env:
        return None
    values = {}
    for name in ("RANK", "WORLD_SIZE"):
        try:
            values[name] = int(env.get(name, ""))
        except ValueError:
            raise UsageError(f"{name}={env.get(name)!r}: must be an integer") from None
    rank, size = values["RANK"], values["WORLD_SIZE"]
    if size < 1 or not 0 <= rank < size:
        raise UsageError(f"RANK={rank} WORLD_SIZE={size}: need 0 <= RANK < WORLD_SIZE")
    return World(rank, size)


def serve_store(size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on loopback; ``.port`` is the port the OS gave it (no
    probe-then-bind race with other runs on the machine)."""
    return dist.TCPStore(
        LOOPBACK,
        0,
        size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def announce(world: World, timeout_s: float) -> None:
    """A worker tells the store it is up (before forming the group), so that rank 0 can
    wait for its workers while watching them, not block in the group's rendezvous."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world.size,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    store.set(JOINED_KEY.format(rank=world.rank), "1")


def join(
    world: World,
    device: torch.device,
    timeout_s: float,
    store: dist.Store | None = None,
) -> None:
    """Form the default process group (``store``: rank 0's own; else env://)."""
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already initialised")
    kwargs: dict[str, Any] = {"init_method": "env://"}
    if store is not None:
        # env:// prefixes its store's keys (torch.distributed.init_process_group); so
        # does rank 0 on its own store, or the workers joining by env:// never meet it.
        kwargs = {"store": dist.PrefixStore(ENV_STORE_PREFIX, store)}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        rank=world.rank,
        world_size=world.size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )


def leave(clean: bool = True) -> None:
    """Leave the group, so that none of it outlives this call.

    ``clean`` (this rank finished, as every rank does): a barrier first, so that no rank
    tears its group down while another still talks to it. After an error it is skipped:
    a dead rank would fail it, a stalled one hold it for the group's timeout.

    Why the group must be *gone* here, its native threads joined: a group still alive at
    interpreter exit is destroyed (or not) in teardown order, with gloo's worker and TCP
    loop threads running; that aborted rank 1 of ``run --world-size 2 --shard-base``
    ("terminate called without an active exception", SIGABRT) about once in ten runs
    under load. ``destroy_process_group`` only drops torch's own references: a sharded
    base (FSDP2) keeps the group alive through its DeviceMesh, held by the DTensors and by
    DTensor's sharding-propagation caches, which outlive the model. Callers drop their
    engine before leaving; this clears those caches and collects the model's reference
    cycles, so the group's C++ destructor runs now and joins its threads.
    """
    if not dist.is_initialized():
        return
    try:
        if clean:
            dist.barrier()
    finally:
        dist.destroy_process_group()
        left = release_group()
        if left:
            log.warning(
                "the process group outlived destroy_process_group (threads %s still run): "
                "something still holds it",
                ", ".join(left),
            )


def release_group() -> list[str]:
    """Free what still holds a destroyed group (DTensor's caches, the cycles of a dropped
    sharded model); the gloo threads still running after, [] when the group is gone."""
    if "torch.distributed.tensor" in sys.modules:  # a sharded base ran here
        from torch.distributed.tensor import debug

        # Their entries hold DTensorSpecs, whose DeviceMesh holds the group (no public
        # API clears them; this is the one torch's own tests use).
        debug._clear_sharding_prop_cache()
    gc.collect()
    return group_threads()


def group_threads() -> list[str]:
    """The names of this process's live gloo threads (Linux; [] elsewhere)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name in GLOO_THREADS:
            names.append(name)
    return sorted(names)


def broadcast_object(obj: Any, device: torch.device | None = None) -> Any:
    """Rank 0's ``obj`` on every rank (pickled; NCCL stages it on ``device``)."""
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, device=device if _nccl() else None)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (pickled)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_tensors(tensors: Sequence[torch.Tensor]) -> None:
    """Overwrite every rank's tensors with rank 0's, in place (one bucket at a time)."""
    for bucket in _buckets(list(tensors), BUCKET_BYTES):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.broadcast(flat, src=0)
        _unflatten_into(flat, bucket)


@torch.no_grad()
def all_reduce_lora_grads(
    params: Sequence[torch.nn.Parameter],
    slots: slice | None = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> None:
    """Sum the LoRA parameters' gradients over the ranks, in place, bucketed.

    ``params`` are the stacked LoRA tensors (optim.PerAdapterAdamW.params), ``slots``
    the slot range in play (the others hold no gradient this tick): only those rows of
    each gradient travel. A SUM, with no division, because each rank's loss weights
    are the whole tick's (``1 / rows of its experiment`` over every rank's rows,
    training.fused_backward's ``row_counts``): each rank's gradient is its share of the
    one-rank gradient, and the shares add up to it.

    A parameter without a gradient on any rank keeps ``grad`` None (the optimiser does
    not step it, as with one rank); one with a gradient somewhere gets the sum on every
    rank (zeros where a rank had none, e.g. a rank with no rows this tick).
    """
    present = torch.tensor(
        [p.grad is not None for p in params], dtype=torch.int32, device=_device_of(params)
    )
    dist.all_reduce(present, op=dist.ReduceOp.MAX)
    grads: list[torch.Tensor] = []
    for p, anywhere in zip(params, present.tolist(), strict=True):
        if not anywhere:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad if slots is None else p.grad[slots])
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        _unflatten_into(flat, bucket)


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, up to ``bucket_bytes`` each (a larger
    tensor is a bucket alone). The same tensors give the same buckets on every rank."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        last = buckets[-1] if buckets else None
        fits = last is not None and size + nbytes <= bucket_bytes
        if fits and last[0].dtype == t.dtype and last[0].device == t.device:
            last.append(t)
            size += nbytes
        else:
            buckets.append([t])
            size = nbytes
    return buckets


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def _device_of(params: Sequence[torch.nn.Parameter]) -> torch.device:
    return params[0].device if params else torch.device("cpu")


def _nccl() -> bool:
    return dist.get_backend() == "nccl"
