"""The Tinker futures table's bounds, per namespace (server/tinker/future_table.py), and the live
sessions' (server/tinker/state.py): pure, with the real table, futures and registry; the real
engine's side is test_tinker_tenancy.py."""

from __future__ import annotations

import time

import pytest
from loraplex_engine.server.tinker.future_table import FutureLimits, FutureTable
from loraplex_engine.server.tinker.state import Registry
from loraplex_engine.spec.errors import TooManyRequests


def test_a_full_namespace_evicts_its_oldest_finished_future_retrieved_ones_first() -> None:
    table = FutureTable(FutureLimits(per_namespace=3))
    first, second, third = (table.new("team-a", "Sample") for _ in range(3))
    first.finish({}), second.finish({})
    table.retrieved(second)
    fourth = table.new("team-a", "Sample")  # the retrieved one goes, not the older one
    assert table.get("team-a", second.request_id) is None
    assert table.get("team-a", first.request_id) is first
    table.new("team-a", "Sample")  # then the oldest finished
    assert table.get("team-a", first.request_id) is None
    assert table.get("team-a", third.request_id) is third and fourth.state == "pending"


def test_only_pending_futures_past_the_cap_are_refused_and_only_for_their_namespace() -> None:
    table = FutureTable(FutureLimits(per_namespace=2))
    table.new("team-b", "Sample"), table.new("team-b", "Sample")
    with pytest.raises(TooManyRequests, match=r"'team-b'.*--tinker-futures-per-namespace 2"):
        table.new("team-b", "Sample")
    assert table.new("team-a", "Sample").namespace == "team-a"  # another namespace goes on


def test_the_same_request_id_in_two_namespaces_is_two_futures() -> None:
    table = FutureTable()
    mine = table.new("team-b", "OptimStep", "s1:train:0", "s1:train:0#1")
    squat = table.new("team-a", "OptimStep", "s1:train:0", "s1:train:0#1")
    assert table.get("team-b", "s1:train:0#1") is mine
    assert table.get("team-a", "s1:train:0#1") is squat


def test_a_retrieved_future_goes_after_the_grace_an_unretrieved_one_after_the_ttl() -> None:
    table = FutureTable(FutureLimits(per_namespace=10, ttl_s=0.2, grace_s=0.05))
    retrieved, kept, pending = (table.new("team-a", "Sample") for _ in range(3))
    retrieved.finish({}), kept.finish({})
    table.retrieved(retrieved)
    time.sleep(0.1)
    table.sweep()
    assert table.get("team-a", retrieved.request_id) is None
    assert table.get("team-a", kept.request_id) is kept
    time.sleep(0.15)
    table.sweep()
    assert table.get("team-a", kept.request_id) is None
    assert table.get("team-a", pending.request_id) is pending  # never dropped while pending


def test_live_sessions_are_capped_per_namespace() -> None:
    registry = Registry(max_sessions=3)
    for _ in range(3):
        registry.new_session("team-a", None)
    with pytest.raises(TooManyRequests, match=r"'team-a' has 3 open Tinker sessions"):
        registry.new_session("team-a", None)
    assert registry.new_session("team-b", None).namespace == "team-b"


def test_the_retrieved_grace_outlasts_the_sdks_own_wait_for_a_lost_answer() -> None:
    """The official SDK asks again for a future only when its answer was lost on the way:
    after its retrieve call's timeout (read here from the installed SDK's source) and its
    backoff (1, 2, 4, 8 s). A grace shorter than that turns a lost answer into a 404 for a
    future the engine finished (seen with the cookbook's chat_sl on a loaded machine)."""
    import inspect
    import re

    from loraplex_engine.spec.tinker_limits import RETRIEVED_GRACE_S
    from tinker.lib.api_future_impl import _APIFuture

    source = inspect.getsource(_APIFuture._fetch_via_rest)
    sdk_timeout_s = float(re.search(r"\btimeout=(\d+(?:\.\d+)?)", source).group(1))
    assert sdk_timeout_s + 1 + 2 + 4 + 8 < RETRIEVED_GRACE_S, (RETRIEVED_GRACE_S, sdk_timeout_s)
