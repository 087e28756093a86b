"""Which rank trains which rows of a tick, under data parallelism (data_parallel.py).

Pure: the same rows give the same split on every rank, so each rank can compute its own
share from the tick's rows without being told. Whole prompt groups go to one rank, so a
group's prompt is still computed once (training.py's shared prefix) and no group's rows
are split between two ranks' micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence

from loraplex_engine.training import TrainRow


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
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    units = row_units(rows)
    cost = [sum(rows[i].length for i in unit) for unit in units]
    order = sorted(range(len(units)), key=lambda u: (-cost[u], u))
    load = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for u in order:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        load[rank] += cost[u]
        shares[rank] += units[u]
    return [sorted(share) for share in shares]


def split_rows_by_rank(rows: Sequence[TrainRow], world_size: int) -> list[list[TrainRow]]:
    """Per rank, its rows in the tick's order (see ``split_row_indices``)."""
    return [[rows[i] for i in share] for share in split_row_indices(rows, world_size)]
