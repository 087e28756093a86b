"""Sampling options through the official SDK against a real ``loraplex-engine serve
--tinker-keys``, checked against transformers running the same tiny model: greedy tokens
and their log-probs and top-k (``topk_sample_logprobs``), prompt log-probs (and their
top-k) of the whole prompt and of its
last N positions only (``prompt_logprobs_last_n``), and bad values answered 422 naming
the field.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from tinker import types
from transformers import AutoModelForCausalLM

from tests.support.server_process import EngineServer, tinker_engine_fixture
from tests.support.tinker_clients import service_client

pytestmark = pytest.mark.slow

KEY = "tml-team-a-0123456789abcdef"
PROMPT = [1, 40, 41, 42, 43, 44, 45]
NEW = 5
ATOL = 2e-4  # float32, another kernel path


server = tinker_engine_fixture("tinker-sample-options", {"team-a": KEY}, max_adapters=2)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of PROMPT and the log-softmax at every position
    of prompt + continuation ([len - 1, vocab]: row i predicts token i + 1)."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        logp = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return ids[len(PROMPT) :], logp


def _sampler(server: EngineServer):
    client = service_client(server.url, KEY)
    r = httpx.get(f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY})
    base = r.json()["supported_models"][0]["model_name"]
    return client, client.create_sampling_client(base_model=base).result()


def test_greedy_tokens_and_logprobs_match_transformers(server, reference) -> None:
    client, sampler = _sampler(server)
    greedy = types.SamplingParams(max_tokens=NEW, temperature=0.0)
    got = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result()
    tokens, logp = reference
    seq = got.sequences[0]
    assert seq.tokens == tokens
    ref = [float(logp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(tokens)]
    np.testing.assert_allclose(seq.logprobs, ref, atol=ATOL)
    client.close("success").result()


def test_topk_of_each_sampled_token_matches_transformers(server, reference) -> None:
    """``topk_sample_logprobs``: at every sampled position the k likeliest tokens, likeliest
    first (the greedy token leads), with transformers' log-probs."""
    client, sampler = _sampler(server)
    greedy = types.SamplingParams(max_tokens=NEW, temperature=0.0)
    got = sampler.sample(
        types.ModelInput.from_ints(PROMPT), 2, greedy, topk_sample_logprobs=3
    ).result()
    tokens, logp = reference
    for seq in got.sequences:
        assert seq.tokens == tokens and len(seq.topk_logprobs) == NEW
        for i, tops in enumerate(seq.topk_logprobs):
            top = logp[len(PROMPT) - 1 + i].topk(3)
            assert [t for t, _ in tops] == top.indices.tolist() and tops[0][0] == tokens[i]
            np.testing.assert_allclose([lp for _, lp in tops], top.values.tolist(), atol=ATOL)
    client.close("success").result()


@pytest.mark.parametrize("last_n", [None, 3])
def test_prompt_logprobs_and_their_topk_match_transformers(server, reference, last_n) -> None:
    client, sampler = _sampler(server)
    params = types.SamplingParams(max_tokens=1, temperature=0.0)
    got = sampler.sample(
        types.ModelInput.from_ints(PROMPT), 1, params,
        include_prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=last_n,
    ).result()  # fmt: skip
    _, logp = reference
    skipped = len(PROMPT) - (last_n or len(PROMPT) - 1)  # position 0 is never scored
    assert got.prompt_logprobs[:skipped] == [None] * skipped
    assert got.topk_prompt_logprobs[:skipped] == [None] * skipped
    for i in range(skipped, len(PROMPT)):
        row = logp[i - 1]
        assert got.prompt_logprobs[i] == pytest.approx(float(row[PROMPT[i]]), abs=ATOL)
        top = row.topk(2)
        ids = [t for t, _ in got.topk_prompt_logprobs[i]]
        assert ids == top.indices.tolist()
        lps = [lp for _, lp in got.topk_prompt_logprobs[i]]
        np.testing.assert_allclose(lps, top.values.tolist(), atol=ATOL)
    client.close("success").result()


@pytest.mark.parametrize(
    "extra",
    [
        {"prompt_logprobs": True, "prompt_logprobs_last_n": 0},
        {"prompt_logprobs": True, "prompt_logprobs_last_n": len(PROMPT)},
        {"prompt_logprobs_last_n": 2},  # without prompt logprobs
        {"prompt_logprobs": True, "prompt_logprobs_last_n": "2"},
    ],
)
def test_a_bad_last_n_names_its_field(server, extra) -> None:
    body = {
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 1},
        "base_model": httpx.get(
            f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY}
        ).json()["supported_models"][0]["model_name"],
        **extra,
    }
    r = httpx.post(f"{server.url}/api/v1/asample", json=body, headers={"X-API-Key": KEY})
    assert r.status_code == 422 and r.json()["error"]["field"] == "prompt_logprobs_last_n", r.text
