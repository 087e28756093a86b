"""``/retrieve_futures`` and ``/cancel_future`` on a real ``loraplex-engine serve
--tinker-keys``: the official SDK samples through its session poller (the engine turns
``sample_use_retrieve_futures`` and ``sample_cancel_enabled`` on), the queue's cursor
semantics over HTTP as the SDK's poller sends them, and both routes scoped to the key's
namespace (another's session or request answers 404 naming the field).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from tinker import types

from tests.support.server_process import EngineServer, tinker_engine_fixture
from tests.support.tinker_clients import service_client

pytestmark = pytest.mark.slow

KEY_A = "tml-team-a-0123456789abcdef"
KEY_B = "tml-team-b-0123456789abcdef"
PROMPT = [1, 40, 41, 42]


server = tinker_engine_fixture("tinker-futures", {"team-a": KEY_A, "team-b": KEY_B}, max_adapters=2)


def post(
    server: EngineServer, route: str, body: dict[str, Any], key: str = KEY_A
) -> httpx.Response:
    return httpx.post(
        f"{server.url}/api/v1/{route}", json=body, headers={"X-API-Key": key}, timeout=60
    )


def base(server: EngineServer) -> str:
    r = httpx.get(f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY_A})
    return r.json()["supported_models"][0]["model_name"]


def sampling_session(server: EngineServer) -> str:
    sid = post(server, "create_session", {"tags": [], "sdk_version": "test"}).json()["session_id"]
    body = {"session_id": sid, "sampling_session_seq_id": 0, "base_model": base(server)}
    return post(server, "create_sampling_session", body).json()["sampling_session_id"]


def asample(server: EngineServer, session: str, seq_id: int, max_tokens: int = 4) -> str:
    body = {
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0},
        "sampling_session_id": session,
        "seq_id": seq_id,
    }
    r = post(server, "asample", body)
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


def poll(server: EngineServer, session: str, clone: int = 0, **extra: Any) -> httpx.Response:
    target = {
        "type": "sampling_session",
        "sampling_session_id": session,
        "cloned_sampler_id": clone,
    }
    return post(server, "retrieve_futures", {"target": target, **extra})


def test_the_sdk_samples_through_its_session_poller(server) -> None:
    config = post(server, "client/config", {}).json()
    assert config["sample_use_retrieve_futures"] is True
    assert post(server, "client/dynamic_config", {}).json()["sample_cancel_enabled"] is True
    client = service_client(server.url, KEY_A)
    sampler = client.create_sampling_client(base_model=base(server)).result()
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    prompt = types.ModelInput.from_ints(PROMPT)
    with ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(lambda: sampler.sample(prompt, 2, params).result()) for _ in range(4)
        ]
        got = [f.result(timeout=300) for f in futures]
    tokens = [s.tokens for r in got for s in r.sequences]
    assert len(tokens) == 8 and all(len(t) == 4 for t in tokens)
    assert all(t == tokens[0] for t in tokens)  # greedy: the same text every time
    client.close("success").result()


def test_a_completion_is_reported_once_past_its_cursor_and_acknowledged(server) -> None:
    session = sampling_session(server)
    rid = asample(server, session, seq_id=0)
    first = poll(server, session, timeout=30).json()
    assert first["completions"] == [{"state": "finished", "request_id": rid}]
    assert first["cursor"] > 0
    # Past its cursor, with the id reported retrieved: nothing new, same cursor, at once.
    started = time.monotonic()
    again = poll(
        server, session, prev_cursor=first["cursor"], timeout=0, retrieved_request_ids=[rid]
    ).json()
    assert again == {"completions": [], "cursor": first["cursor"]}
    assert time.monotonic() - started < 5
    # A clone's samples (seq_id in its 1e9 block) are its own queue.
    rid2 = asample(server, session, seq_id=3 * 1_000_000_000)
    assert (
        poll(server, session, clone=0, prev_cursor=first["cursor"], timeout=1).json()["completions"]
        == []
    )
    clone = poll(server, session, clone=3, timeout=30).json()
    assert [c["request_id"] for c in clone["completions"]] == [rid2]
    assert clone["cursor"] > first["cursor"]


def test_another_namespace_can_neither_poll_nor_cancel(server) -> None:
    session = sampling_session(server)
    rid = asample(server, session, seq_id=0)
    target = {"sampling_session_id": session}
    r = post(server, "retrieve_futures", {"target": target, "timeout": 0}, key=KEY_B)
    assert r.status_code == 404 and r.json()["error"]["field"] == "target.sampling_session_id"
    r = post(server, "cancel_future", {"request_id": rid}, key=KEY_B)
    assert r.status_code == 404 and r.json()["error"]["field"] == "request_id"
    r = post(server, "retrieve_futures", {"target": target, "timeout": -1})
    assert r.status_code == 422 and r.json()["error"]["field"] == "timeout"


def test_a_cancelled_sample_fails_as_cancelled_and_is_reported(server) -> None:
    session = sampling_session(server)
    rids = [asample(server, session, seq_id=i, max_tokens=256) for i in range(4)]
    for rid in rids:
        assert post(server, "cancel_future", {"request_id": rid}).status_code == 200
    answers = [post(server, "retrieve_future", {"request_id": rid}).json() for rid in rids]
    cancelled = [a for a in answers if "cancelled" in str(a.get("error"))]
    assert cancelled, answers  # four 256-token samples cannot all be done already
    done = poll(server, session, timeout=30).json()["completions"]
    states = {c["request_id"]: c["state"] for c in done}
    pairs = zip(rids, answers, strict=True)
    assert all(states.get(rid) == "failed" for rid, a in pairs if a in cancelled)
