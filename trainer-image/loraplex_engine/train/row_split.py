"""Which rank trains which rows of a tick, and which rank decodes which rollout rows,
under data parallelism (parallel/data_parallel.py).

Pure: the same rows give the same split on every rank, so each rank can compute its own
share from the tick's rows without being told. Whole prompt groups go to one rank, so a
group's prompt is still computed once (train/step.py's shared prefix) and no group's rows
are split between two ranks' micro-batches.

Rollouts split coarser, by sampling stream (``rollout_units``): an experiment's rows
draw their randomness from its one generator, one seed per micro-batch it is decoded in
(rollout/sampling.py), so decoded whole on one rank, in the micro-batches rollout/torch/packing.py
gives it alone, they sample exactly what one rank decoding everything samples.
"""

from __future__ import annotations

from collections.abc import Sequence

from loraplex_engine.rollout.base import RolloutRequest
from loraplex_engine.train.rows import TrainRow


def row_units(rows: Sequence[TrainRow]) -> list[list[int]]:
    """Row indices grouped into the units a rank takes whole: one per prompt group of an
    experiment (``(experiment, group)``); a row without a group is a unit alone. Units and
    their members are in first-seen order."""
    units: dict[object, list[int]] = {}
    for i, row in enumerate(rows):
        key = ("row", i) if row.group is None else (row.experiment, row.group)
        units.setdefault(key, []).append(i)
    return list(units.values())


def split_row_indices(rows: Sequence[TrainRow], world_size: int) -> list[list[int]]:
    """Per rank, the indices of its rows (ascending): whole units, token-balanced.

    Greedy largest-first (LPT): units by tokens (prompt + completion of each row),
    largest first, each to the rank with the fewest tokens so far; ties go to the
    earlier unit and the lower rank, so the split depends on the rows alone. A rank may
    get no rows (fewer units than ranks): it still takes part in the gradient all-reduce.
    """
    units = row_units(rows)
    return _largest_first(units, [sum(rows[i].length for i in unit) for unit in units], world_size)


def _largest_first(
    units: list[list[int]],
    cost: list[int],
    world_size: int,
    pinned: Sequence[int] = (),
    pinned_cost: int = 0,
) -> list[list[int]]:
    """LPT: ``pinned`` rows on rank 0 first, then units by cost, largest first, each to
    the least-loaded rank (ties: the earlier unit, the lower rank)."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    order = sorted(range(len(units)), key=lambda u: (-cost[u], u))
    load = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    shares[0] += pinned
    load[0] = pinned_cost
    for u in order:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        load[rank] += cost[u]
        shares[rank] += units[u]
    return [sorted(share) for share in shares]


def split_rows_by_rank(rows: Sequence[TrainRow], world_size: int) -> list[list[TrainRow]]:
    """Per rank, its rows in the tick's order (see ``split_row_indices``)."""
    return [[rows[i] for i in share] for share in split_row_indices(rows, world_size)]


def rollout_units(requests: Sequence[RolloutRequest]) -> tuple[list[list[int]], list[int]]:
    """Rollout rows grouped into the units a rank decodes whole: one per sampling stream
    (experiment and generator), first-seen order; and the rows pinned to rank 0: those
    with a sink (a served completion streams to rank 0's HTTP client as it decodes)."""
    units: dict[tuple[str, object], list[int]] = {}
    pinned: list[int] = []
    for i, req in enumerate(requests):
        if req.sink is not None:
            pinned.append(i)
            continue
        # A generator is one stream wherever its rows are (a stream must not be split:
        # each rank would advance its own copy); rows without one go by experiment.
        key = ("group", req.group) if req.generator is None else ("generator", id(req.generator))
        units.setdefault(key, []).append(i)
    return list(units.values()), pinned


def split_rollout(requests: Sequence[RolloutRequest], world_size: int) -> list[list[int]]:
    """Per rank, the indices of the rollout rows it decodes (ascending): whole sampling
    streams, balanced by KV tokens (prompt + token limit), largest first; rows with a
    sink on rank 0. Deterministic (rank 0 computes it and sends it with the rows)."""
    units, pinned = rollout_units(requests)

    def cost(rows: list[int]) -> int:
        return sum(len(requests[i].prompt_ids) + requests[i].max_new_tokens for i in rows)

    return _largest_first(units, [cost(u) for u in units], world_size, pinned, cost(pinned))
