"""Inflight sampling clients through the official SDK against a real ``loraplex-engine
serve --tinker-keys``: every inflight client of a model samples the weights it last
published (an older client adopts the newer save), each sample names in its sequence ids
the one published checkpoint it ran on, a snapshot client keeps its own weights, and a
bad ``kind`` is a 422 naming the field.
"""

from __future__ import annotations

import httpx
import pytest
from tinker import types

from tests.support.server_process import tinker_engine_fixture
from tests.support.tinker_clients import service_client, sft

pytestmark = pytest.mark.slow

KEY = "tml-team-a-0123456789abcdef"
PROMPT = [1, 40, 41, 42]
ANSWER = [100, 101, 102, 103]
GREEDY = types.SamplingParams(max_tokens=len(ANSWER), temperature=0.0)


server = tinker_engine_fixture("tinker-inflight", {"team-a": KEY})


def _say(sampler) -> tuple[list[int], str]:
    got = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result()
    return got.sequences[0].tokens, got.sequences[0].sequence_id


def test_inflight_clients_share_the_models_latest_published_weights(server) -> None:
    client = service_client(server.url, KEY)
    r = httpx.get(f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY})
    base = r.json()["supported_models"][0]["model_name"]
    tc = client.create_lora_training_client(base_model=base, rank=8, seed=0).result()
    before = tc.save_weights_and_get_sampling_client().result()  # a snapshot
    first = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    said_before, seq_1 = _say(first)
    assert said_before != ANSWER
    for _ in range(40):
        tc.forward_backward([sft(PROMPT, ANSWER)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.005)).result()
    second = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    said_first, seq_first = _say(first)  # the older inflight client adopts the new save
    said_second, seq_second = _say(second)
    assert said_first == ANSWER and said_second == ANSWER
    # Each sample names the one checkpoint it ran on: the first save, then the second.
    name_1, name_2 = seq_1.split("@")[1], seq_second.split("@")[1]
    assert name_1 != name_2 and seq_first.split("@")[1] == name_2
    assert _say(before)[0] == said_before  # the snapshot keeps its weights
    client.close("success").result()


def test_an_unknown_kind_or_a_named_inflight_save_names_the_field(server) -> None:
    client = service_client(server.url, KEY)
    r = httpx.get(f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY})
    base = r.json()["supported_models"][0]["model_name"]
    tc = client.create_lora_training_client(base_model=base, rank=4, seed=0).result()
    for body in ({"kind": "bogus"}, {"kind": "inflight", "path": "mine"}):
        r = httpx.post(
            f"{server.url}/api/v1/save_weights_for_sampler",
            json={"model_id": tc.model_id, **body},
            headers={"X-API-Key": KEY},
        )
        assert r.status_code == 422 and r.json()["error"]["field"] == "kind", r.text
    client.close("success").result()
