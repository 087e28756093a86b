"""A training tick's working set under paging (tick/working_set.py): pinned experiments
keep their slots, a waiting sample keeps one free, experiments and client models share
the rest, and experiments take turns least recently served first. The choice reads only
the pager's counts and each experiment's id, so the pager and experiments here are
plain stand-ins (the engine-level behaviour: tests/engine/memory/test_paging.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from loraplex_engine.tick.working_set import WorkingSets


@dataclass
class _Pager:  # what WorkingSets reads of memory/paging.AdapterPager
    slots: int
    pages: dict = field(default_factory=lambda: {"someone": object()})
    enabled: bool = True

    @property
    def model(self) -> SimpleNamespace:
        return SimpleNamespace(max_adapters=self.slots)


def _exps(n: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(id=f"e{i}") for i in range(n)]


def test_experiments_take_turns_and_the_pinned_keep_their_slots() -> None:
    sets = WorkingSets(_Pager(slots=4))  # type: ignore[arg-type]
    exps = _exps(7)
    pinned = {"e6"}
    seen: list[list[str]] = []
    for _ in range(3):
        ws = sets.choose(exps, lambda e: e.id in pinned, client_demand=0, samples=False)
        seen.append([e.id for e in ws.experiments])
        assert ws.pinned == frozenset(pinned) and ws.client_room == 0
    assert seen[0] == ["e6", "e0", "e1", "e2"]  # 4 slots: the pinned one, then 3 in turn
    assert seen[1] == ["e6", "e3", "e4", "e5"]
    assert seen[2] == ["e6", "e0", "e1", "e2"]


def test_clients_and_experiments_share_and_a_sample_keeps_a_slot_free() -> None:
    sets = WorkingSets(_Pager(slots=8))  # type: ignore[arg-type]
    ws = sets.choose(_exps(10), lambda e: False, client_demand=10, samples=True)
    assert (len(ws.experiments), ws.client_room) == (4, 3)  # 7 = 8 - the sample's slot
    ws = sets.choose(_exps(2), lambda e: False, client_demand=10, samples=False)
    assert (len(ws.experiments), ws.client_room) == (2, 6)  # what experiments leave
    ws = sets.choose(_exps(10), lambda e: False, client_demand=1, samples=False)
    assert (len(ws.experiments), ws.client_room) == (7, 1)


def test_nothing_paged_or_paging_off_takes_every_experiment() -> None:
    for pager in (_Pager(slots=2, pages={}), _Pager(slots=2, enabled=False)):
        ws = WorkingSets(pager).choose(_exps(5), lambda e: False, 3, True)  # type: ignore[arg-type]
        assert len(ws.experiments) == 5 and ws.client_room is None
