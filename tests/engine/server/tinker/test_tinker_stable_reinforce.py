"""The official tinker SDK against a real ``loraplex-engine serve --tinker-keys``: the
``stable_reinforce`` loss end to end. A sampling client with ``record_stability_info``
gets a ``sequence_id`` per sequence and the engine records what it sampled; training
names those sequences through the datum's provenance (``Datum.with_provenance``, as the
cookbook's rl_loop builds it) and trains on the engine's recorded log-probs, not the
client's; a span that lies about its tokens or names an unknown sequence is a 422 naming
it, while a co-tenant's call at the same time trains; the recordings are bounded.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from tests.support.server_process import EngineServer, tinker_engine_fixture, wait_until
from tests.support.tinker_clients import service_client

pytestmark = pytest.mark.slow

KEY_A = "tml-team-a-0123456789abcdef"
KEY_B = "tml-team-b-0123456789abcdef"
PROMPT = [1, 40, 41, 42]
CAP_TOKENS = 600  # --tinker-recorded-tokens: a few samples' worth

server = tinker_engine_fixture(
    "tinker-stable-reinforce",
    {"team-a": KEY_A, "team-b": KEY_B},
    flags=["--tinker-recorded-tokens", str(CAP_TOKENS)],
)
REFUSED = (tinker.UnprocessableEntityError, tinker.RequestFailedError)


@pytest.fixture
def client(server: EngineServer) -> Iterator[tinker.ServiceClient]:
    c = service_client(server.url, KEY_A)
    yield c
    c.close("success").result()


@pytest.fixture(scope="module")
def base(server: EngineServer) -> str:
    r = httpx.get(f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY_A})
    return r.json()["supported_models"][0]["model_name"]


def sample(tc: tinker.TrainingClient, n: int = 2, max_tokens: int = 6) -> types.SampleResponse:
    sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=7)
    return sc.sample(types.ModelInput.from_ints(PROMPT), n, params).result()


def rl_datum(
    seq: types.SampledSequence,
    advantage: float,
    *,
    logprobs: list[float] | None = None,
    provenance: bool = True,
    tamper_input: bool = False,
) -> types.Datum:
    """The cookbook's rl_loop datum (recipes/rl_loop.py): the prompt then all but the last
    sampled token in, zeros as the prompt's targets, the sampled tokens' advantage, and
    its ``with_sampled_provenance``. ``logprobs``: the client's copy (default: the
    sampler's); ``tamper_input``: one sampled input token changed."""
    sampled = list(seq.tokens)
    ob = len(PROMPT) - 1
    inputs = PROMPT + sampled[:-1]
    if tamper_input:
        inputs[len(PROMPT)] = (inputs[len(PROMPT)] + 1) % 50
    lp = list(seq.logprobs or []) if logprobs is None else logprobs
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(inputs),
        loss_fn_inputs={
            "target_tokens": np.array([0] * ob + sampled, np.int64),
            "logprobs": np.array([0.0] * ob + lp, np.float32),
            "advantages": np.array([0.0] * ob + [advantage] * len(sampled), np.float32),
        },
    )
    if not provenance:
        return datum
    sid = seq.sequence_id
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=len(PROMPT)),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(PROMPT) - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled)),
        ],
    )


def test_recorded_sequences_round_trip_and_train_on_the_engines_logprobs(client, base) -> None:
    tc = client.create_lora_training_client(base_model=base, rank=4, seed=0).result()
    out = sample(tc)
    ids = [s.sequence_id for s in out.sequences]
    assert len(set(ids)) == 2 and all(ids), ids
    # The client's logprobs are lies (all 0): the engine trains on its own record.
    advantages = [1.5, -0.5]
    data = [
        rl_datum(s, a, logprobs=[0.0] * len(s.tokens))
        for s, a in zip(out.sequences, advantages, strict=True)
    ]
    result = tc.forward_backward(data, "stable_reinforce").result()
    ob = len(PROMPT) - 1
    for seq, adv, got in zip(out.sequences, advantages, result.loss_fn_outputs, strict=True):
        logp = got["logprobs"].to_numpy()
        recorded = np.asarray(seq.logprobs, np.float32)
        expected = np.concatenate(
            [np.zeros(ob), -np.exp(logp[ob:] - recorded) * adv]  # prompt targets: no loss
        )
        np.testing.assert_allclose(
            got["elementwise_loss"].to_numpy(), expected, rtol=1e-5, atol=1e-6
        )
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_a_span_that_lies_is_a_422_naming_it_while_a_co_tenant_trains(server, client, base) -> None:
    tc = client.create_lora_training_client(base_model=base, rank=4, seed=0).result()
    seqs = sample(tc).sequences
    other = service_client(server.url, KEY_B)
    tb = other.create_lora_training_client(base_model=base, rank=4, seed=0).result()
    theirs = sample(tb).sequences
    bad = [rl_datum(seqs[0], 1.0), rl_datum(seqs[1], 1.0, tamper_input=True)]
    with ThreadPoolExecutor(2) as pool:
        mine = pool.submit(lambda: tc.forward_backward(bad, "stable_reinforce").result())
        good = pool.submit(
            lambda: tb.forward_backward([rl_datum(theirs[0], 1.0)], "stable_reinforce").result()
        )
        with pytest.raises(REFUSED, match=r"data\[1\]\.model_input_spans\[1\]"):
            mine.result()
        assert len(good.result().loss_fn_outputs) == 1
    # Another namespace's (or an unknown) sequence id: unknown here, naming the field.
    stolen = rl_datum(theirs[1], 1.0)
    with pytest.raises(REFUSED, match=r"data\[0\]\.model_input_spans\[0\]\.sequence_id"):
        tc.forward_backward([stolen], "stable_reinforce").result()
    # Without provenance: the loss says what it needs.
    bare = rl_datum(seqs[0], 1.0, provenance=False)
    with pytest.raises(REFUSED, match=r"data\[0\]\.loss_fn_input_spans"):
        tc.forward_backward([bare], "stable_reinforce").result()
    other.close("success").result()


def test_its_gradient_is_importance_samplings_on_the_recorded_logprobs(client, base) -> None:
    """Three identical adapters (one seed): importance_sampling with the sampler's log-probs
    as the datum's, stable_reinforce with the client's log-probs zeroed (so only the
    recorded ones can give the same gradient), and stable_reinforce with 3x the
    advantages. Their gradient norms (optim_step's metric) must be equal, equal, 3x."""
    tcs = [
        client.create_lora_training_client(base_model=base, rank=4, seed=3).result()
        for _ in range(3)
    ]
    seqs = sample(tcs[0], n=4).sequences
    adv = [1.0, -1.0, 0.5, -0.25]
    is_data = [rl_datum(s, a, provenance=False) for s, a in zip(seqs, adv, strict=True)]
    zeroed = [[0.0] * len(s.tokens) for s in seqs]
    sr = [rl_datum(s, a, logprobs=z) for s, a, z in zip(seqs, adv, zeroed, strict=True)]
    sr3 = [rl_datum(s, 3 * a, logprobs=z) for s, a, z in zip(seqs, adv, zeroed, strict=True)]
    tcs[0].forward_backward(is_data, "importance_sampling").result()
    tcs[1].forward_backward(sr, "stable_reinforce").result()
    tcs[2].forward_backward(sr3, "stable_reinforce").result()
    norms = [
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm:mean"]
        for tc in tcs
    ]
    assert norms[0] > 1e-6, norms
    assert norms[1] == pytest.approx(norms[0], rel=1e-4), norms
    assert norms[2] == pytest.approx(3 * norms[0], rel=1e-4), norms


def test_recordings_are_capped_per_namespace_oldest_pushed_out(client, base) -> None:
    tc = client.create_lora_training_client(base_model=base, rank=4, seed=0).result()
    # One request that alone could pass the cap is refused before it samples.
    sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    big = types.SamplingParams(max_tokens=64, temperature=1.0)
    with pytest.raises(REFUSED, match="record_stability_info"):
        sc.sample(types.ModelInput.from_ints(PROMPT), CAP_TOKENS // 64 + 1, big).result()
    first = sample(tc, n=2, max_tokens=6).sequences[0]
    for _ in range(CAP_TOKENS // (len(PROMPT) + 12) + 1):  # more than the cap holds
        last = sample(tc, n=2, max_tokens=6).sequences[0]
    tc.forward_backward([rl_datum(last, 1.0)], "stable_reinforce").result()
    with pytest.raises(REFUSED) as refused:
        tc.forward_backward([rl_datum(first, 1.0)], "stable_reinforce").result()
    assert "pushed out" in str(refused.value), refused.value
    assert "data[0].model_input_spans[0].sequence_id" in str(refused.value), refused.value


def _recorded_bytes(server: EngineServer, token: bool = True) -> dict[str, float]:
    """``loraplex_engine_tinker_recorded_bytes`` by namespace, as /metrics answers it (with
    the engine's token, or as anyone on the port)."""
    headers = server.headers if token else {}
    text = httpx.get(f"{server.url}/metrics", headers=headers).text
    return {
        s.labels["namespace"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "loraplex_engine_tinker_recorded_bytes"
    }


def test_the_recordings_memory_is_a_gauge_per_namespace(server, base) -> None:
    c = service_client(server.url, KEY_B)
    tc = c.create_lora_training_client(base_model=base, rank=4, seed=0).result()
    out = sample(tc, n=2, max_tokens=6)
    # int32 prompt and tokens, float32 log-probs: what the recording holds
    held = 4 * len(PROMPT) + sum(8 * len(s.tokens) for s in out.sequences)
    assert _recorded_bytes(server).get("team-b") == held
    assert "team-b" not in _recorded_bytes(server, token=False)  # a tenant label: token only
    c.close("success").result()  # its session's end frees them: no series left
    wait_until(lambda: "team-b" not in _recorded_bytes(server), timeout=30)
