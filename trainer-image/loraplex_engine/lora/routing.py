"""Which rows of a batch go to which adapter slot: the routing every multi-LoRA layer of
one forward shares (built once per batch), and the per-call router that derives it."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from loraplex_engine.spec.errors import RoutingError


@dataclass(frozen=True)
class Routing:
    """How a batch's rows map onto slot groups; built once per batch, shared by all layers."""

    batch: int
    rows: Tensor  # [n] rows that have an adapter, grouped by slot
    group: Tensor  # [n] group index of each of those rows
    pos: Tensor  # [n] position of the row inside its group
    slots: Tensor  # [g] slot of each group
    width: int  # rows in the largest group
    in_order: bool  # rows == all rows, in order (tenants already contiguous): no gather needed
    slot_set: frozenset[int] = frozenset()  # host-side copy of ``slots``: no sync per layer
    # For the grouped path (lora/grouped.py); host-side, so no sync per layer:
    counts: tuple[int, ...] = ()  # rows of each group
    starts: tuple[int, ...] = ()  # first row of each group, then the row count
    slot_list: tuple[int, ...] = ()  # ``slots`` in group order
    row_slots: Tensor | None = None  # [n] slot of each row
    row_ends: Tensor | None = None  # [g] int32 end row of each group (``offs`` in rows)
    slot_ids: Tensor | None = field(default=None, compare=False, repr=False)  # what was routed
    ranks: Mapping[int, int] = field(default_factory=dict, compare=False)  # slot -> rank
    # ``offs`` and the rank-ordered routing, built on first use (see token_offs, ranked).
    _cache: dict[Any, Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def dense(self) -> bool:
        """Every group has ``width`` rows, so the grouped rows need no padding."""
        return self.rows.numel() == self.slots.numel() * self.width

    def token_offs(self, first: int, end: int, tokens: int) -> Tensor:
        """``offs`` for groups ``first:end`` as one grouped matmul: each group's end token,
        counted from the first group's start. Built once per routing, shared by the layers
        (and by a checkpointed layer's recompute)."""
        key = (first, end, tokens)
        if key not in self._cache:
            assert self.row_ends is not None
            self._cache[key] = (self.row_ends[first:end] - self.starts[first]) * tokens
        return self._cache[key]  # type: ignore[no-any-return]

    def ranked(self) -> Routing:
        """The same rows with the groups ordered by (rank, slot), so that the slots of one
        rank are adjacent and the grouped path runs one pair of grouped matmuls per rank,
        not per pair of differing neighbours. Built once (one host sync), then shared."""
        if "ranked" not in self._cache:
            order = sorted(self.slot_list, key=lambda s: (self.ranks.get(s, 0), s))
            same = order == list(self.slot_list)
            self._cache["ranked"] = self if same else self._reordered(order)
        return self._cache["ranked"]  # type: ignore[no-any-return]

    def _reordered(self, order: list[int]) -> Routing:
        """Group by each slot's place in ``order`` (slot 0 stays 0), then name the slots."""
        assert self.slot_ids is not None
        device = self.slot_ids.device
        label = torch.zeros(max(order) + 1, dtype=torch.long)
        label[order] = torch.arange(1, len(order) + 1)
        by_label = Routing.build(label.to(device)[self.slot_ids])
        assert by_label is not None
        slots = torch.tensor(order, device=device)
        return replace(
            by_label,
            slots=slots,
            slot_set=self.slot_set,
            slot_list=tuple(order),
            row_slots=slots[by_label.group],
            slot_ids=self.slot_ids,
            ranks=self.ranks,
        )

    @classmethod
    def build(cls, slot_ids: Tensor, ranks: Mapping[int, int] | None = None) -> Routing | None:
        """None when no row has an adapter (the whole batch is the base model).

        ``ranks`` (slot -> adapter rank) orders the groups of ``ranked()``."""
        rows = torch.nonzero(slot_ids, as_tuple=True)[0]
        if rows.numel() == 0:
            return None
        order = torch.argsort(slot_ids[rows], stable=True)
        rows = rows[order]
        slots, group, counts = torch.unique_consecutive(
            slot_ids[rows], return_inverse=True, return_counts=True
        )
        ends = torch.cumsum(counts, 0)
        pos = torch.arange(rows.numel(), device=rows.device) - (ends - counts)[group]
        in_order = rows.numel() == len(slot_ids) and bool((order[1:] > order[:-1]).all())
        host_counts, slot_list = counts.tolist(), slots.tolist()
        return cls(
            len(slot_ids),
            rows,
            group,
            pos,
            slots,
            max(host_counts),
            in_order,
            frozenset(slot_list),
            tuple(host_counts),
            (0, *itertools.accumulate(host_counts)),  # host arithmetic: no extra sync
            tuple(slot_list),
            slots[group],
            ends.to(torch.int32),
            slot_ids,
            dict(ranks or {}),
        )


class Router:
    """Per-row slot ids for one forward or ``generate`` call.

    ``generate`` may expand each prompt into ``k`` rows (``num_return_sequences``, beams)
    with ``repeat_interleave``; the plan for such a batch is derived from the same ids.
    ``ranks`` (slot -> its adapter's rank) lets the grouped path put equal ranks together.
    """

    def __init__(self, slot_ids: Tensor, ranks: Mapping[int, int] | None = None) -> None:
        self.slot_ids = slot_ids
        self.ranks = dict(ranks or {})
        self._plans: dict[int, Routing | None] = {}

    def plan(self, batch: int) -> Routing | None:
        if batch not in self._plans:
            n = len(self.slot_ids)
            if batch % n:
                raise RoutingError(f"batch of {batch} rows does not fit {n} slot ids")
            ids = self.slot_ids.repeat_interleave(batch // n)
            self._plans[batch] = Routing.build(ids, self.ranks)
        return self._plans[batch]
