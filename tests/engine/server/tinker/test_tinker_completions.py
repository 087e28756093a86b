"""Sampling sessions' completion queues (server/tinker/completions.py) on their own: the
cursor a poller holds stays valid when a queue empties and is made again, a queue keeps
at most its cap, a cancel reaches only pending samples of its own namespace, and a poll's
fields are checked by name."""

from __future__ import annotations

import asyncio

import pytest
from loraplex_engine.server.tinker.completions import Completions, Poll, Target, read_poll
from loraplex_engine.server.tinker.future_table import FutureTable
from loraplex_engine.spec.errors import InvalidRequestError, NotFoundError

T = Target("team-a", "s1:sample:0", 0)


def _sample(table: FutureTable, done: Completions, target: Target = T, finish: bool = True):
    fut = table.new(target.namespace, "Sample")
    done.tracked(fut, target, lambda: fut.finish(b"answer") if finish else None)()
    return fut


def _poll(done: Completions, prev: int, retrieved: tuple[str, ...] = ()) -> dict:
    return asyncio.run(done.poll(Poll(T, prev, 0.0, retrieved)))


def test_cursors_keep_rising_across_a_queue_made_again() -> None:
    table = FutureTable()
    done = Completions(table)
    a = _sample(table, done)
    first = _poll(done, 0)
    assert first["completions"] == [{"state": "finished", "request_id": a.request_id}]
    assert _poll(done, first["cursor"], (a.request_id,)) == {
        "completions": [],
        "cursor": first["cursor"],
    }
    assert list(done.queued()) == []  # acknowledged and empty: dropped
    b = _sample(table, done)
    again = _poll(done, first["cursor"])
    assert [c["request_id"] for c in again["completions"]] == [b.request_id]
    assert again["cursor"] > first["cursor"]
    assert a.retrieved is not None  # reported retrieved: the table drops it after the grace


def test_a_queue_keeps_at_most_its_cap() -> None:
    table = FutureTable()
    done = Completions(table, max_queued=3)
    futs = [_sample(table, done) for _ in range(5)]
    got = _poll(done, 0)["completions"]
    assert [c["request_id"] for c in got] == [f.request_id for f in futs[2:]]


def test_cancel_fails_a_pending_sample_once_and_reaches_no_other_namespace() -> None:
    table = FutureTable()
    done = Completions(table)
    fut = table.new("team-a", "Sample")
    job = done.tracked(fut, T, lambda: fut.finish(b"late"))
    with pytest.raises(NotFoundError):
        done.cancel("team-b", fut.request_id)
    done.cancel("team-a", fut.request_id)
    job()  # the worker reaches it after the cancel: it never runs, the failure stays
    assert fut.state == "failed" and "cancelled" in (fut.error or "")
    assert _poll(done, 0)["completions"] == [{"state": "failed", "request_id": fut.request_id}]
    fut.finish(b"later still")  # an answer arriving after the cancel is dropped
    assert fut.state == "failed"
    training = table.new("team-a", "ForwardBackward")
    with pytest.raises(InvalidRequestError) as e:
        done.cancel("team-a", training.request_id)
    assert e.value.field == "request_id"


@pytest.mark.parametrize(
    "body,field",
    [
        ({}, "target"),
        ({"target": {"sampling_session_id": ""}}, "target.sampling_session_id"),
        (
            {"target": {"sampling_session_id": "s", "cloned_sampler_id": -1}},
            "target.cloned_sampler_id",
        ),
        ({"target": {"sampling_session_id": "s"}, "prev_cursor": "1"}, "prev_cursor"),
        ({"target": {"sampling_session_id": "s"}, "timeout": float("nan")}, "timeout"),
        (
            {"target": {"sampling_session_id": "s"}, "retrieved_request_ids": [1]},
            "retrieved_request_ids",
        ),
    ],
)
def test_a_bad_poll_names_its_field(body: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        read_poll("team-a", body, 10.0)
    assert e.value.field == field
