"""The table of samples recorded for stable_reinforce (server/tinker/recorded.py): what it
answers, and its bounds (a namespace's token cap, least recently used pushed out; the
idle TTL, restarted by use; a session's end), each saying why a sequence is gone."""

from __future__ import annotations

import pytest
from loraplex_engine.server.tinker.recorded import Found, Recorder
from loraplex_engine.spec.errors import InvalidRequestError
from loraplex_engine.spec.tinker_limits import RecordLimits
from loraplex_engine.spec.training_service import SampledRow


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rows(n: int, length: int = 3) -> list[SampledRow]:
    return [SampledRow(list(range(i, i + length)), [-0.5] * length, "length") for i in range(n)]


def put(rec: Recorder, key: str, ns: str = "a", session: str = "s1", n: int = 2) -> list[str]:
    ids = [f"{key}:{i}" for i in range(n)]
    rec.record(ns, session, key, ids, [1, 2, 3, 4], rows(n), "tinker://m/sampler_weights/x")
    return ids


def test_a_recording_answers_its_own_session_only() -> None:
    rec = Recorder()
    ids = put(rec, "r1")
    found = rec.find("a", "s1", ids[1])
    assert isinstance(found, Found)
    assert found.prompt.tolist() == [1, 2, 3, 4] and found.sequence.tokens.tolist() == [1, 2, 3]
    assert found.version == "tinker://m/sampler_weights/x"
    assert isinstance(rec.find("a", "s2", ids[1]), str)  # another session
    assert isinstance(rec.find("b", "s1", ids[1]), str)  # another namespace
    assert rec.held_tokens("a") == 4 + 2 * 3
    assert rec.held_bytes("a") == 4 * 4 + 2 * 3 * 8 and rec.held_bytes("b") == 0


def test_the_cap_pushes_out_the_least_recently_used() -> None:
    rec = Recorder(RecordLimits(tokens_per_namespace=30))  # 10 tokens a recording
    first, second, third = put(rec, "r1"), put(rec, "r2"), put(rec, "r3")
    assert isinstance(rec.find("a", "s1", first[0]), Found)  # r1 used: r2 is now oldest
    fourth = put(rec, "r4")
    assert "pushed out" in str(rec.find("a", "s1", second[0]))
    for ids in (first, third, fourth):
        assert isinstance(rec.find("a", "s1", ids[0]), Found)
    assert rec.held_tokens("a") == 30
    put(rec, "r5", ns="b")  # another namespace has its own cap
    assert isinstance(rec.find("a", "s1", first[0]), Found)


def test_one_request_over_the_cap_is_refused_before_it_samples() -> None:
    rec = Recorder(RecordLimits(tokens_per_namespace=100))
    rec.check_fits(4, 2, 48)
    with pytest.raises(InvalidRequestError) as e:
        rec.check_fits(4, 2, 49)
    assert e.value.field == "record_stability_info"


def test_an_unused_recording_expires_and_use_restarts_its_time() -> None:
    clock = Clock()
    rec = Recorder(RecordLimits(ttl_s=60.0), clock=clock)
    used, idle = put(rec, "r1"), put(rec, "r2")
    clock.now += 50
    assert isinstance(rec.find("a", "s1", used[0]), Found)
    clock.now += 20  # r2 idle 70 s, r1 20 s
    rec.sweep()
    assert isinstance(rec.find("a", "s1", used[0]), Found)
    assert "expired" in str(rec.find("a", "s1", idle[0]))
    assert rec.held_tokens("a") == 10


def test_a_sessions_end_frees_its_recordings() -> None:
    rec = Recorder()
    mine, theirs = put(rec, "r1"), put(rec, "r2", session="s2")
    rec.end_session("a", "s1")
    assert "session has ended" in str(rec.find("a", "s1", mine[0]))
    assert isinstance(rec.find("a", "s2", theirs[0]), Found)
    rec.sweep(session_open=lambda ns, sid: False)  # the registry says s2 is gone too
    assert rec.held_bytes() == 0
