"""Data parallelism (issue 17, first slice): the row split, the gradient all-reduce over
real gloo processes, and `loraplex-engine run --world-size 2` against `--world-size 1`."""

from __future__ import annotations

import random

import pytest
from loraplex_engine.row_split import row_units, split_row_indices, split_rows_by_rank
from loraplex_engine.training import TrainRow


def row(exp: str, group: int | None, prompt: int, completion: int) -> TrainRow:
    return TrainRow(
        exp, 1, list(range(prompt)), [7] * completion, [0.0] * completion, 0.5, 1.0, group
    )


def groups_of(rows: list[TrainRow], share: list[TrainRow]) -> set[tuple[str, int | None]]:
    return {(r.experiment, r.group) for r in share}


def test_whole_prompt_groups_go_to_one_rank() -> None:
    rows = [row(e, g, 4 + g, 3) for e in ("a", "b") for g in range(5) for _ in range(4)]
    random.Random(0).shuffle(rows)
    shares = split_rows_by_rank(rows, 3)
    assert sorted(id(r) for s in shares for r in s) == sorted(id(r) for r in rows)
    seen = [groups_of(rows, s) for s in shares]
    for i in range(3):
        for j in range(i + 1, 3):
            assert not seen[i] & seen[j], "a prompt group split between ranks"
    # each rank keeps the tick's row order
    for share in shares:
        positions = [next(k for k, r in enumerate(rows) if r is x) for x in share]
        assert positions == sorted(positions)


def test_token_balanced_largest_first() -> None:
    """LPT on units of 3, 10, 2, 9, 8, 2 tokens over 2 ranks: 10 -> rank 0, 9 -> 1,
    8 -> 1 (9 < 10), 3 -> 0, 2 -> 0, 2 -> 0 (15 < 17): 17 tokens each."""
    sizes = [3, 10, 2, 9, 8, 2]  # one row per group: prompt 1 + completion size - 1
    rows = [row("a", g, 1, n - 1) for g, n in enumerate(sizes)]
    assert split_row_indices(rows, 2) == [[0, 1, 2, 5], [3, 4]]
    # a unit of several rows weighs their sum: 4 rows of 6 outweigh one of 20
    rows = [row("a", 0, 3, 3) for _ in range(4)] + [row("a", 1, 10, 10)]
    assert split_row_indices(rows, 2) == [[0, 1, 2, 3], [4]]


def test_deterministic_and_independent_of_world_size_one() -> None:
    rows = [row("a", g % 3, 5, 1 + g) for g in range(12)]
    assert split_row_indices(rows, 4) == split_row_indices(list(rows), 4)
    assert split_row_indices(rows, 1) == [list(range(12))]


def test_rows_without_a_group_are_units_alone_and_ranks_may_be_empty() -> None:
    rows = [row("a", None, 3, 2), row("a", None, 3, 2), row("b", 0, 3, 2), row("b", 0, 3, 2)]
    assert row_units(rows) == [[0], [1], [2, 3]]
    shares = split_row_indices(rows, 5)
    assert sorted(len(s) for s in shares) == [0, 0, 1, 1, 2]
    assert split_row_indices([], 2) == [[], []]
    with pytest.raises(ValueError, match="world_size"):
        split_row_indices(rows, 0)


def test_groups_of_different_experiments_are_different_units() -> None:
    rows = [row("a", 0, 3, 2), row("b", 0, 3, 2)]
    assert row_units(rows) == [[0], [1]]
    assert sorted(map(len, split_row_indices(rows, 2))) == [1, 1]
