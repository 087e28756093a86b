"""Serving inside fair share (tick/time_share.py), checked directly: which kind of tick
runs next, how seconds are charged, and which queued requests a serving tick takes."""

from __future__ import annotations

import pytest
from loraplex_engine.tick.time_share import TimeShare, take_in_turn


def run(share: TimeShare, ticks: int, seconds: dict[str, float], **work: bool) -> dict[str, float]:
    """Pick and charge ``ticks`` ticks whose kinds take ``seconds``; seconds per kind."""
    spent = dict.fromkeys(("train", "serve"), 0.0)
    for _ in range(ticks):
        kind = share.pick(train=work.get("train", True), serve=work.get("serve", True))
        assert kind is not None
        share.charge(kind, seconds[kind])
        spent[kind] += seconds[kind]
    return spent


def both_busy(share: TimeShare, ticks: int) -> list[str]:
    """The kinds of ``ticks`` one-second ticks while both kinds have work."""
    kinds = []
    for _ in range(ticks):
        kind = share.pick(train=True, serve=True)
        assert kind is not None
        share.charge(kind, 1.0)
        kinds.append(kind)
    return kinds


@pytest.mark.parametrize(
    ("serve_s", "train_s"),
    [(0.1, 0.1), (4.0, 0.05), (0.01, 2.0)],  # serving ticks as long as, far longer, far shorter
)
def test_both_busy_each_kind_gets_its_share_of_the_time(serve_s: float, train_s: float) -> None:
    """Whatever each kind's tick costs, the seconds split 25/75; the error is at most one
    tick of the longer kind over the whole run."""
    spent = run(TimeShare(0.25), 2000, {"serve": serve_s, "train": train_s})
    total = sum(spent.values())
    assert abs(spent["serve"] / total - 0.25) <= max(serve_s, train_s) / total + 1e-9, spent


def test_a_kind_alone_gets_every_tick_and_no_work_is_none() -> None:
    share = TimeShare(0.25)
    assert run(share, 50, {"serve": 1.0, "train": 1.0}, serve=False)["serve"] == 0.0
    assert run(share, 50, {"serve": 1.0, "train": 1.0}, train=False)["train"] == 0.0
    assert share.pick(train=False, serve=False) is None


def test_idle_time_is_not_banked() -> None:
    """An hour of training alone buys serving no run of ticks when requests come: from
    then on the split is the shares', not serving catching up on the hour."""
    share = TimeShare(0.25)
    run(share, 3600, {"serve": 1.0, "train": 1.0}, serve=False)
    kinds = both_busy(share, 8)
    assert kinds.count("serve") == 2, kinds


def test_a_pause_with_no_work_at_all_banks_nothing_either() -> None:
    """Serving alone for a while, then nothing, then training alone, then both: the split
    from then on is the shares' (training does not owe serving's solo time)."""
    share = TimeShare(0.25)
    run(share, 60, {"serve": 1.0, "train": 1.0}, train=False)
    assert share.pick(train=False, serve=False) is None
    run(share, 5, {"serve": 1.0, "train": 1.0}, serve=False)
    kinds = both_busy(share, 8)
    assert kinds.count("serve") == 2, kinds


def test_a_request_waits_at_most_the_tick_in_progress() -> None:
    """Level after waiting, serving wins the tie: the first pick with a request serves it."""
    share = TimeShare(0.25)
    run(share, 10, {"serve": 1.0, "train": 1.0}, serve=False)
    assert share.pick(train=True, serve=True) == "serve"


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.5, 2.0])
def test_a_share_outside_zero_one_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="serving_share must be between 0 and 1"):
        TimeShare(bad)


def test_a_serving_tick_takes_requests_in_turn_across_models_within_the_budget() -> None:
    """Model a floods the queue; b's request, queued after all of a's, goes in the first
    tick; the budget stops the take, and what is left keeps its order."""
    queue = [("a", 1, 10), ("a", 2, 10), ("a", 3, 10), ("b", 1, 10), ("a", 4, 10)]
    taken, left = take_in_turn(queue, lambda j: j[0], lambda j: j[2], 25)
    assert taken == [("a", 1, 10), ("b", 1, 10)]
    assert left == [("a", 2, 10), ("a", 3, 10), ("a", 4, 10)]


def test_a_serving_tick_takes_one_request_over_the_budget_alone() -> None:
    """A request costs at most a step's bound (the completion limits), so it is served,
    alone, even where the budget is smaller."""
    taken, left = take_in_turn([("a", 1, 50), ("b", 1, 1)], lambda j: j[0], lambda j: j[2], 10)
    assert (taken, left) == ([("a", 1, 50)], [("b", 1, 1)])
    assert take_in_turn([], lambda j: j, lambda j: 0, 10) == ([], [])
