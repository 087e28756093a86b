"""The Tinker door's input checks, unit by unit: ``sampling_params`` and the prompt
(server/tinker/sampling_params.py), ``user_metadata`` (server/tinker/metadata.py), the
``forward_backward`` body's decompressed size and token count (server/tinker/wire.py); on the
engine's side, a completion job's own values checked before the shared batch
(completion_jobs.check_tensors), and the engine loop, which never counts a request's
own error toward its failed-tick limit (server/serve.EngineLoop). The end-to-end view is
test_tinker_input_bounds.py."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import zstandard
from loraplex_engine.completion_jobs import CompletionJob, check_tensors
from loraplex_engine.metrics import EngineMetrics
from loraplex_engine.server.serve import EngineLoop
from loraplex_engine.server.tinker import wire
from loraplex_engine.server.tinker.metadata import MAX_METADATA_BYTES, check_metadata
from loraplex_engine.server.tinker.sampling_params import (
    ECHO_CHARS,
    prompt_tokens,
    sample_call,
    sampling_params,
)
from loraplex_engine.spec.errors import BodyTooLargeError, InvalidRequestError
from loraplex_engine.spec.service import PromptJob
from loraplex_engine.spec.training_service import Limits
from tinker.proto import tinker_public_pb2 as pb

VOCAB = 473
LIMITS = Limits(vocab=VOCAB, context=None, max_tokens=1024)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"top_k": 1e20}, "top_k"),
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": VOCAB + 1}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": "5"}, "top_k"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 1000.0}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"max_tokens": "x"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 4.0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": "abc"}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [1, "a"]}, "stop"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stop": "x" * 257}, "stop"),
        ({"stop": [-1]}, "stop"),
        ({"stop": [VOCAB]}, "stop[0]"),
        ({"stop": {"a": 1}}, "stop"),
    ],
)
def test_a_wrong_sampling_param_is_refused_naming_it(raw: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        sampling_params(raw, VOCAB)
    assert e.value.field == f"sampling_params.{field}"


def test_the_sdks_own_sampling_params_pass_as_they_are() -> None:
    p = sampling_params(
        {"max_tokens": 8, "seed": 7, "stop": ["\n", "."], "temperature": 0.7, "top_k": 40,
         "top_p": 0.9, "future_field": 1},
        VOCAB,
    )  # fmt: skip
    assert (p.max_tokens, p.seed, p.temperature, p.top_k, p.top_p) == (8, 7, 0.7, 40, 0.9)
    assert p.stop_strings == ["\n", "."] and p.stop_ids == []
    assert sampling_params({"stop": [2, 3], "temperature": 1}, VOCAB).stop_ids == [2, 3]
    assert sampling_params({"stop": "END"}, VOCAB).stop_strings == ["END"]
    assert sampling_params(None, VOCAB).top_k == -1
    assert sampling_params({"top_k": VOCAB}, VOCAB).top_k == VOCAB


def test_a_refusal_never_echoes_a_huge_value_whole() -> None:
    with pytest.raises(InvalidRequestError) as e:
        sampling_params({"stop": ["a" * 10] * 1_000_000}, VOCAB)
    assert len(e.value.message) < 400


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        (None, "prompt.chunks"),
        ({"chunks": []}, "prompt.chunks"),
        ({"chunks": [{"type": "image", "data": "x"}]}, "prompt.chunks[0]"),
        ({"chunks": [{"tokens": [1, "2"]}]}, "prompt.chunks[0].tokens[1]"),
        ({"chunks": [{"tokens": [1, 2.0]}]}, "prompt.chunks[0].tokens[1]"),
        ({"chunks": [{"tokens": [1, VOCAB]}]}, "prompt.chunks[0].tokens[1]"),
        ({"chunks": [{"tokens": [-1]}]}, "prompt.chunks[0].tokens[0]"),
        ({"chunks": [{"tokens": "abc"}]}, "prompt.chunks[0].tokens"),
        ({"chunks": [{"tokens": [1] * 2000}]}, "prompt.chunks"),
    ],
)
def test_a_wrong_prompt_is_refused_naming_where(prompt: object, field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        prompt_tokens(prompt, VOCAB, LIMITS.max_tokens)
    assert e.value.field == field


def test_a_sample_body_becomes_its_call() -> None:
    body = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}, {"tokens": [3]}]},
        "num_samples": 2,
        "sampling_params": {"max_tokens": 5, "top_k": 3, "seed": 9, "stop": [4]},
        "topk_prompt_logprobs": 2,
    }
    call = sample_call(body, LIMITS)
    assert call.prompt_ids == [1, 2, 3] and call.num_samples == 2 and call.max_tokens == 5
    assert (call.top_k, call.seed, call.stop_token_ids) == (3, 9, [4])
    assert call.prompt_logprobs and call.topk_prompt_logprobs == 2
    for name, value in (("num_samples", 0), ("num_samples", "2"), ("topk_prompt_logprobs", 99)):
        with pytest.raises(InvalidRequestError) as e:
            sample_call({**body, name: value}, LIMITS)
        assert e.value.field == name


def test_user_metadata_is_bounded() -> None:
    assert check_metadata(None) is None
    assert check_metadata({"run": "a", "n": 3, "nested": {"x": [1, 2]}}) is not None
    for bad in (
        {f"k{i}": "v" for i in range(65)},
        {"k" * 129: "v"},
        {"notes": "x" * 4097},
        {f"k{i}": "v" * 4000 for i in range(5)},
        {"deep": [["x" * 1000] * 20]},
    ):
        with pytest.raises(ValueError):
            check_metadata(bad)
    fits = {f"k{i}": "v" * 1000 for i in range(15)}
    assert len(json.dumps(fits)) < MAX_METADATA_BYTES and check_metadata(fits) == fits


def _request(tokens: int, shape: list[int] | None = None) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id="s:train:0", loss_fn="cross_entropy", seq_id=1)
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.arange(tokens, dtype=np.int32).tobytes()
    target = datum.loss_fn_inputs["target_tokens"]
    target.dtype = pb.DTYPE_INT64
    target.dense = np.zeros(tokens, dtype=np.int64).tobytes()
    target.shape.extend(shape if shape is not None else [tokens])
    return msg.SerializeToString()


def test_a_zstd_bomb_stops_at_what_max_step_tokens_implies() -> None:
    limit = wire.max_body_bytes(1024)
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 * 1024 * 1024))
    t0 = time.monotonic()
    with pytest.raises(BodyTooLargeError) as e:
        wire.decompress(bomb, "zstd", limit)
    assert time.monotonic() - t0 < 5 and str(limit) in e.value.message
    body = _request(8)
    assert wire.decompress(zstandard.ZstdCompressor().compress(body), "zstd", limit) == body
    with pytest.raises(BodyTooLargeError):
        wire.decompress(b"\0" * (limit + 1), None, limit)


def test_the_token_count_is_checked_before_any_list_is_built() -> None:
    call = wire.read_forward_backward(_request(8), max_tokens=8)
    assert call.data[0].input_ids == list(range(8))
    with pytest.raises(InvalidRequestError) as e:
        wire.read_forward_backward(_request(9), max_tokens=8)
    assert e.value.field == "forward_backward_input.data" and "at most 8" in e.value.message


def test_a_million_entry_shape_is_not_echoed_whole() -> None:
    with pytest.raises(InvalidRequestError) as e:
        wire.read_forward_backward(_request(4, shape=[4] * 1_000_000), max_tokens=1024)
    assert e.value.field == "data[0].loss_fn_inputs.target_tokens.shape"
    assert len(e.value.message) < 2 * ECHO_CHARS + 100


@pytest.mark.parametrize(
    "kw",
    [{"top_k": 2**63}, {"temperature": float("inf")}, {"top_p": float("nan")}, {"max_tokens": -1}],
)
def test_a_job_whose_values_the_batch_cannot_take_fails_alone(kw: dict[str, object]) -> None:
    values = {"max_tokens": 4, "temperature": 1.0, **kw}
    job = CompletionJob.of(PromptJob("base", [1, 2], **values), "base")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        check_tensors(job.job)
    assert job.rows(0) == [] and job.done.is_set()
    with pytest.raises(InvalidRequestError):
        job.answer()
    good = CompletionJob.of(PromptJob("base", [1, 2], 4, 1.0, n=2, top_k=-1), "base")
    assert len(good.rows(0)) == 2 and not good.done.is_set()


class RequestFaultEngine:
    """A TEST DOUBLE of TickingEngine whose every tick ends on a request's own error: the
    loop's counting is the unit here, so no model is needed."""

    def __init__(self) -> None:
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1
        raise InvalidRequestError("top_k is out of range", field="sampling_params.top_k")


def test_a_requests_own_error_never_stops_the_engine_loop() -> None:
    engine = RequestFaultEngine()
    loop = EngineLoop(engine, EngineMetrics(), max_errors=3)  # type: ignore[arg-type]
    loop.start()
    try:
        deadline = time.monotonic() + 10
        while engine.ticks < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.ticks >= 10 and loop.running and not loop.failed
    finally:
        loop.stop(5)


def test_stable_reinforce_is_taken_and_an_unknown_loss_still_named() -> None:
    """stable_reinforce is this engine's reading of the name (docs/design/tinker-protocol.md);
    a name outside the SDK's losses is still refused naming loss_fn."""
    assert wire.loss_call("stable_reinforce", {"kl_coeff": 0.1}).name == "stable_reinforce"
    with pytest.raises(InvalidRequestError) as refused:
        wire.loss_call("stable_reinforce_v2", {})
    assert refused.value.field == "loss_fn"
