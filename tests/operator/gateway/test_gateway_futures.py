"""The SDK's ``retrieve_futures`` and ``cancel_future`` through a real gateway process in
front of a real ``loraplex-engine serve``: a sample key polls its sampling session's
completions, whose request ids come back as the gateway's own (``<engine>~<id>``, what
``retrieve_future`` then takes), acknowledges them, and cancels its samples; another
namespace's key gets 404 for that session and those requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.gateway_process import GatewayProcess
from tests.support.server_process import EngineServer

pytestmark = pytest.mark.slow

KEY_A_RO = "tml-team-a-sample-0123456789"
KEY_B = "tml-team-b-train-0123456789"
PROMPT = [1, 40, 41, 42]


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("gw-futures-engine")
    with EngineServer(tiny_model_dir, work / "ckpt", max_adapters=2, workdir=work) as engine:
        view = {
            "engines": [{"name": "e1", "pool": "pool", "url": engine.url, "token": engine.token}],
            "keys": [
                {"namespace": "team-a", "key": KEY_A_RO, "role": "sample"},
                {"namespace": "team-b", "key": KEY_B, "role": "train"},
            ],
        }
        gw = GatewayProcess(tmp_path_factory.mktemp("gw-futures"), view)
        gw.start()
        try:
            yield gw.url
        finally:
            gw.stop()


def post(url: str, route: str, body: dict[str, Any], key: str = KEY_A_RO) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/{route}", json=body, headers={"X-API-Key": key}, timeout=60)


def test_a_sample_key_polls_acknowledges_and_cancels_through_the_gateway(gateway: str) -> None:
    caps = httpx.get(f"{gateway}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY_A_RO})
    base = caps.json()["supported_models"][0]["model_name"]
    sid = post(gateway, "create_session", {"tags": [], "sdk_version": "t"}).json()["session_id"]
    body = {"session_id": sid, "sampling_session_seq_id": 0, "base_model": base}
    r = post(gateway, "create_sampling_session", body)
    assert r.status_code == 200, r.text
    sampler = r.json()["sampling_session_id"]
    sample = {
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 4, "temperature": 0.0},
        "sampling_session_id": sampler,
        "seq_id": 0,
    }
    rid = post(gateway, "asample", sample).json()["request_id"]
    assert rid.startswith("e1~")
    target = {"sampling_session_id": sampler}
    first = post(gateway, "retrieve_futures", {"target": target, "timeout": 30})
    assert first.status_code == 200, first.text
    assert first.json()["completions"] == [{"state": "finished", "request_id": rid}]
    got = post(gateway, "retrieve_future", {"request_id": rid})
    assert got.status_code == 200 and got.headers["content-type"].startswith(
        "application/x-protobuf"
    )
    cursor = first.json()["cursor"]
    ack = {"target": target, "prev_cursor": cursor, "timeout": 0, "retrieved_request_ids": [rid]}
    assert post(gateway, "retrieve_futures", ack).json() == {"completions": [], "cursor": cursor}
    # Another namespace: neither the session nor the request exists for it.
    r = post(gateway, "retrieve_futures", {"target": target, "timeout": 0}, key=KEY_B)
    assert r.status_code == 404 and r.json()["error"]["field"] == "target.sampling_session_id"
    r = post(gateway, "cancel_future", {"request_id": rid}, key=KEY_B)
    assert r.status_code == 404 and r.json()["error"]["field"] == "request_id"
    # Its own: a cancel of a sample already answered changes nothing, and answers 200.
    assert post(gateway, "cancel_future", {"request_id": rid}).status_code == 200
    r = post(gateway, "cancel_future", {"request_id": "e9~nope"})
    assert r.status_code == 404 and r.json()["error"]["field"] == "request_id"
