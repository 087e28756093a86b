"""The planner's sharded base (issue 17): FSDP2 on a fake process group, per-rank rows.

One rank of an ``N``-rank engine is planned by running torch's own ``fully_shard`` under
``FakeTensorMode`` on a fake process group (``torch.testing._internal.distributed.
fake_pg``: collectives that move no data, as torchtitan's memory estimator uses), so
the tracker sees the rank's real shards and FSDP's real all-gather buffers:

- **layout** (``shard_base``), the engine's own (``parallel/sharding.py`` on the ``fsdp`` branch of
  issue 17, mirrored here while that is unmerged): every decoder layer is one FSDP
  group and the decoder body (embeddings, final norm) the root group, which FSDP keeps
  unsharded from its forward through its backward. Left out of every group
  (``ignored_params``), so whole on every rank: the LoRA slots with their gradients and
  Adam moments (the bucketed all-reduce, the per-adapter step and the checkpoints see
  plain tensors) and the output head (the chunked log-probs call it a data-dependent
  number of times, which would be a different number of collectives per rank); a tied
  head is the embedding, so a tied model's embedding stays whole too.
- **rows** (``rank_rows``): the rank's share of the step's rows, as the engine splits
  them (train/row_split.py: whole prompt groups, token-balanced); rank 0's share is planned
  (the largest, ties to the lowest rank).

``sharded_rank_bytes`` is the arithmetic beside the measurement: the rank's shard of
the base plus FSDP's unsharded groups (the roots, and two layers in flight). The
measurement is what the planner reports: on Llama-3.1-70B's shapes the training peak
holds the root and two layers as the arithmetic says, but the rollout's decode holds
the root and a layer twice over (a group's flat all-gather output outlives its
copy-out until the next group's), 2 GiB more; ``unsharded_reserve`` covers that.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.memory.tracker import LiveBytes
from loraplex_engine.train.row_split import split_rows_by_rank
from loraplex_engine.train.rows import TrainRow

ALL_GATHER = "all_gather"
# FSDP2's default schedule keeps two groups unsharded at once in a training step: the
# one computing and the one prefetched (the next in the forward, the previous in the
# backward).
GROUPS_IN_FLIGHT = 2


def unsharded_reserve(layer_bytes: Sequence[int], root_bytes: Sequence[int]) -> int:
    """Bytes the engine reserves for FSDP's unsharded copies (memory/capacity_plan.py): twice the
    roots and the largest layer. Measured on Llama-3.1-70B's shapes (the planner's
    tracker, event by event): a group's flat all-gather output is freed only once the
    next group's all-gather is copied out, so at the first decode step's first layer
    the root and that layer are both held twice (7.10 GiB = 2 x (1.96 + 1.59)); the
    training step's peak holds less (5.14 GiB: the root and two layers)."""
    return 2 * (sum(root_bytes) + max(layer_bytes, default=0))


@contextmanager
def fake_world(world_size: int) -> Iterator[Any]:
    """A fake process group of ``world_size`` ranks (this process is rank 0) and its
    1-D device mesh; ``None`` for one rank. Refuses to run where a process group is
    already initialised (an engine's real one must not be replaced)."""
    if world_size == 1:
        yield None
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the sharded plan needs its own fake process group; "
                           "torch.distributed is already initialised in this process")  # fmt: skip
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))  # outside FakeTensorMode: it reads values
    finally:
        dist.destroy_process_group()


def decoder_layers(base: nn.Module) -> nn.ModuleList:
    """The base's decoder layers: the ``ModuleList`` of ``num_hidden_layers`` entries."""
    layers = base.config.get_text_config().num_hidden_layers
    for module in base.modules():
        if isinstance(module, nn.ModuleList) and len(module) == layers:
            return module
    raise ValueError(f"{type(base).__name__}: no list of {layers} decoder layers to shard")


def shard_base(model: MultiLoRAModel, mesh: Any) -> None:
    """FSDP2 ``fully_shard`` of the frozen base over ``mesh`` as the engine does it: each
    decoder layer, then the decoder body; the LoRA slots and the head stay whole."""
    from torch.distributed.fsdp import fully_shard

    base = model.base_model
    ignored = {p for layer in model.lora_layers.values() for p in (layer.lora_A, layer.lora_B)}
    head = base.get_output_embeddings()
    if head is not None:
        ignored |= set(head.parameters())  # with a tied head: the embedding too
    for layer in decoder_layers(base):
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
    fully_shard(base.get_decoder(), mesh=mesh, ignored_params=ignored)


@contextmanager
def tag_all_gathers(tracker: LiveBytes) -> Iterator[None]:
    """Tag the buffers FSDP2 allocates to unshard a group (its all-gather output and the
    unsharded parameters copied out of it) as ``ALL_GATHER``."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    originals = {name: getattr(FSDPParamGroup, name) for name in ("unshard", "wait_for_unshard")}

    def tagged(method: Any) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            with tracker.tagging(ALL_GATHER):
                return method(self, *args, **kwargs)

        return run

    for name, method in originals.items():
        setattr(FSDPParamGroup, name, tagged(method))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(FSDPParamGroup, name, method)


def fsdp_groups(module: nn.Module) -> tuple[list[int], list[int]]:
    """Unsharded bytes of every FSDP2 group under ``module``: (non-root groups, roots).

    A group is a ``fully_shard``-ed module's own parameters (those of its subtree not in
    a nested group); a root has no group above it. Parameters left out of every group
    (``ignored_params``: the LoRA slots) are plain tensors, not ``DTensor``s, and count
    in none. Both lists are empty for a base that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    def own(m: nn.Module) -> int:
        total = sum(_full_bytes(p) for p in m.parameters(recurse=False))
        return total + sum(own(c) for c in m.children() if not isinstance(c, FSDPModule))

    layers: list[int] = []
    roots: list[int] = []

    def walk(m: nn.Module, inside: bool) -> None:
        if isinstance(m, FSDPModule):
            (layers if inside else roots).append(own(m))
            inside = True
        for child in m.children():
            walk(child, inside)

    walk(module, False)
    return layers, roots


def _full_bytes(p: torch.Tensor) -> int:
    """A sharded parameter's unsharded bytes; 0 for one no FSDP group holds."""
    return p.numel() * p.element_size() if hasattr(p, "_local_tensor") else 0


def rank_rows(rows: Sequence[TrainRow], world_size: int) -> list[TrainRow]:
    """Rank 0's share of the step's rows, as the engine splits them (train/row_split.py)."""
    return split_rows_by_rank(rows, world_size)[0]


def sharded_rank_bytes(
    base_bytes: int,
    layer_bytes: Sequence[int],
    root_bytes: Sequence[int],
    world_size: int,
    in_flight: int = GROUPS_IN_FLIGHT,
) -> dict[str, int]:
    """Arithmetic of one rank's base under FSDP, beside the measurement: its shard (each
    group's bytes over ``world_size``, rounded up) and the unsharded copies FSDP holds at
    once: the root groups (``root_bytes``: the decoder's embeddings and norm, the head;
    a root is not resharded between forward and backward) and the ``in_flight``
    largest of the other groups (``layer_bytes``: the decoder layers).

    ``base_bytes`` is the whole base: what no group holds (buffers) is on every rank.
    The measured plan can differ (``plan_sharding`` module doc): FSDP's schedule, not
    this count, decides how many layers are unsharded at a given moment.
    """
    if world_size < 1 or in_flight < 0:
        raise ValueError("world_size must be at least 1 and in_flight at least 0")
    groups = [*layer_bytes, *root_bytes]
    if sum(groups) > base_bytes:
        raise ValueError(f"groups hold {sum(groups)} bytes, more than the base's {base_bytes}")
    shard = sum(-(-g // world_size) for g in groups) + (base_bytes - sum(groups))
    if world_size == 1:
        return {"shard": shard, "all_gather": 0}
    layers = sorted(layer_bytes, reverse=True)[:in_flight]
    return {"shard": shard, "all_gather": sum(root_bytes) + sum(layers)}
