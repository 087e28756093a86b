"""OpenAI clients against a real engine: the official ``openai`` package and ``litellm``,
pointed at a `loraplex-engine serve` process (tiny model with a chat template, one
experiment training meanwhile) as an OpenAI-compatible base URL. No fakes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from loraplex_engine.server.openai.chat import room_left

from tests.support.server_process import EngineServer, wait_until
from tests.support.server_specs import put_body, small_spec
from tests.support.vllm_env import VLLM_PYTHON, skip_without_vllm

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the internet

import litellm  # reads the variable above at import
import openai

pytestmark = pytest.mark.slow

EXP = "default.say-yes"


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh tiny model: the builder writes its chat template (the shared one in
    .cache may predate that)."""
    from loraplex_engine.dev.tiny_model import build_model

    return build_model(tmp_path_factory.mktemp("models") / "tiny-chat")


@pytest.fixture(scope="module")
def server(chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("openai")
    srv = EngineServer(chat_model_dir, work / "ckpt", max_adapters=2, max_rank=8, workdir=work)
    srv.start()
    with srv.client() as api:
        r = api.put(f"/v1/experiments/{EXP}", json=put_body(EXP, small_spec()))
        assert r.status_code == 201, r.text
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def client(server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.token, max_retries=0)


@pytest.fixture(scope="module")
def base(server: EngineServer) -> str:
    with server.client() as api:
        return api.get("/v1/capacity").json()["model"]


def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


# ---- /v1/completions ------------------------------------------------------------------


def test_usage_and_finish_reason_come_from_the_sampled_tokens(client, base) -> None:
    r = client.completions.create(model=base, prompt="hello", max_tokens=4, logprobs=0)
    [choice] = r.choices
    assert r.object == "text_completion" and r.model == base
    sampled = len(choice.logprobs.token_logprobs)
    assert r.usage.completion_tokens == sampled <= 4
    assert choice.finish_reason == ("length" if sampled == 4 else "stop")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_logprobs_report_the_sampled_token_and_its_alternatives(client, base) -> None:
    r = client.completions.create(
        model=base, prompt="the answer", max_tokens=6, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token_lp, alts in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(alts) <= 3 and all(v <= 0 for v in alts.values())
        assert token_lp == pytest.approx(max(alts.values()))  # greedy: the most likely
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=base, prompt="x", logprobs=6)
    assert e.value.body["param"] == "logprobs"


def test_seed_reproduces_and_top_p_narrows_the_sample(client, base) -> None:
    def sample(**kw: Any) -> list[str]:
        r = client.completions.create(model=base, prompt="abc", max_tokens=8, n=3, **kw)
        return [c.text for c in r.choices]

    assert sample(seed=7) == sample(seed=7)
    assert sample(seed=7) != sample(seed=8)
    greedy = client.completions.create(model=base, prompt="abc", max_tokens=8, temperature=0)
    # top_p tiny: only the most likely token is ever kept, at any temperature.
    assert sample(top_p=1e-6, temperature=2.0, seed=1) == [greedy.choices[0].text] * 3


def test_stop_strings_cut_the_text_and_free_the_row(client, base) -> None:
    def usable(text: str) -> int | None:  # a spot past the start with two whole characters
        return next((i for i in range(2, len(text) - 1) if "\ufffd" not in text[i : i + 2]), None)

    # A random tiny model may babble byte pieces only: take the first prompt it does not.
    for prompt in ("q", "the answer", "abc", "hello world", "1 2 3"):
        full = client.completions.create(model=base, prompt=prompt, max_tokens=16, temperature=0)
        text = full.choices[0].text
        if (start := usable(text)) is not None:
            break
    assert start is not None, "no prompt gave a completion with two whole characters"
    stop = text[start : start + 2]
    r = client.completions.create(
        model=base, prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "never-seen"]
    )
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < full.usage.completion_tokens


def test_echo_and_token_id_prompts(client, base, chat_model_dir) -> None:
    r = client.completions.create(model=base, prompt="echo me", max_tokens=3, echo=True)
    assert r.choices[0].text.startswith("echo me")
    ids = tokenizer(chat_model_dir)("count to three").input_ids
    one = client.completions.create(model=base, prompt=ids, max_tokens=3, temperature=0)
    assert one.usage.prompt_tokens == len(ids)
    text = client.completions.create(
        model=base, prompt="count to three", max_tokens=3, temperature=0
    )
    assert one.choices[0].text == text.choices[0].text
    two = client.completions.create(model=base, prompt=[ids, ids[:2]], max_tokens=2)
    assert len(two.choices) == 2 and two.usage.prompt_tokens == len(ids) + 2
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=base, prompt=[1, 2, 10**6], max_tokens=2)
    assert e.value.body["param"] == "prompt[2]" and "vocabulary" in e.value.body["message"]


def test_neutral_defaults_are_accepted(client) -> None:
    r = client.completions.create(
        model=EXP,
        prompt=["a", "b"],
        max_tokens=2,
        n=2,
        best_of=2,
        presence_penalty=0,
        frequency_penalty=0.0,
        logit_bias={},
        user="eval-team",
        stream=False,
        echo=False,
        suffix=None,
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1.0),
        ("logit_bias", {"5": 10}),
        ("best_of", 3),
        ("suffix", "tail"),
    ],
)
def test_a_parameter_that_would_change_results_is_refused(client, base, param, value) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=base, prompt="x", max_tokens=2, **{param: value})
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param == err["field"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_request"
    assert param in err["message"]


def test_error_shapes(client, server, base) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="default.nope", prompt="x")
    assert set(e.value.body) >= {"message", "type", "param", "code", "field"}
    assert e.value.body["code"] == "not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=base, prompt="x", extra_body={"colour": "red"})
    assert e.value.body["param"] == "colour" and "unknown field" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=base, prompt="x", n=99)
    assert e.value.body["param"] == "n"
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.body["type"] == "authentication_error"


# ---- streaming ------------------------------------------------------------------------


def test_a_stream_arrives_while_the_completion_decodes(client, base) -> None:
    """Chunks arrive while the decode runs, not in one burst at its end. 400 tokens (the
    context allows, as the leaving client's test) make the decode last long enough that a
    reader descheduled for a while on a busy machine still sees it spread out."""
    start = time.monotonic()
    arrivals: list[tuple[float, Any]] = []
    stream = client.completions.create(
        model=base,
        prompt="stream",
        max_tokens=400,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        arrivals.append((time.monotonic() - start, chunk))
    texts = [c.choices[0].text for _, c in arrivals if c.choices]
    finals = [t for t, c in arrivals if c.choices and c.choices[0].finish_reason]
    [usage] = [c.usage for _, c in arrivals if c.usage]
    assert len(finals) == 1
    before_final = [t for t, c in arrivals if c.choices and t < finals[0] - 0.05]
    assert len(before_final) >= 5, arrivals[:8]  # tokens left as the decode made them
    whole = client.completions.create(model=base, prompt="stream", max_tokens=400, temperature=0)
    assert "".join(texts) == whole.choices[0].text
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_a_streamed_stop_string_is_held_back_and_cut(client, base) -> None:
    whole = client.completions.create(model=base, prompt="hold", max_tokens=24, temperature=0)
    text = whole.choices[0].text
    start = next(i for i, ch in enumerate(text) if i >= 4 and ch != "\ufffd")
    stop = text[start : start + 3].rstrip("\ufffd") or text[start]
    kw = {"model": base, "prompt": "hold", "max_tokens": 24, "temperature": 0, "stop": stop}
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == client.completions.create(**kw).choices[0].text == text[: text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_client_that_leaves_frees_its_row(server, client, base) -> None:
    kw = {"model": base, "prompt": "long", "max_tokens": 400, "temperature": 0}
    t = time.monotonic()
    whole = client.completions.create(**kw)
    full_s = time.monotonic() - t
    assert whole.usage.completion_tokens == 400, "pick a prompt the tiny model does not end"
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**kw, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
        # Gone after one chunk: the next request waits only for the tick to notice.
        t = time.monotonic()
        r = http.post("/v1/completions", json={"model": base, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200, r.text
    assert time.monotonic() - t < full_s / 2, (time.monotonic() - t, full_s)


# ---- chat -----------------------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "say yes"}]},
]


def test_chat_through_the_template(client, chat_model_dir) -> None:
    r = client.chat.completions.create(
        model=EXP, messages=MESSAGES, max_tokens=5, n=2, logprobs=True, top_logprobs=2
    )
    assert r.object == "chat.completion" and len(r.choices) == 2
    tok = tokenizer(chat_model_dir)
    flat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "say yes"}]
    text = tok.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    assert text.endswith("user: say yes\nassistant:")
    assert r.usage.prompt_tokens == len(tok(text, add_special_tokens=False).input_ids)
    for c in r.choices:
        assert c.message.role == "assistant"
        assert c.finish_reason in ("stop", "length")
        assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)


def test_chat_without_max_tokens_uses_the_room_its_prompt_leaves(
    client, base, chat_model_dir
) -> None:
    context = json.loads((chat_model_dir / "config.json").read_text())["max_position_embeddings"]
    r = client.chat.completions.create(model=base, messages=MESSAGES, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= context
    assert room_left(64, 60, 512) == 4 and room_left(None, 60, 512) == 512
    assert room_left(64, 64, 512) == 1  # the engine's context check then names max_tokens


def test_chat_streams(client, base) -> None:
    kw = {"model": base, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks][-1] in ("stop", "length")
    assert sum(1 for c in chunks if c.choices[0].finish_reason) == 1
    assert content == client.chat.completions.create(**kw).choices[0].message.content


def test_chat_refuses_what_it_cannot_do(client, base) -> None:
    for extra, param in [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"presence_penalty": 1.0}, "presence_penalty"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=base, messages=MESSAGES, **extra)
        assert e.value.body["param"] == param


def test_a_model_without_a_chat_template_says_so(chat_model_dir, tmp_path) -> None:
    plain = shutil.copytree(chat_model_dir, tmp_path / "plain")
    (plain / "chat_template.jinja").unlink()
    with EngineServer(plain, tmp_path / "ckpt", max_adapters=1, max_rank=4) as srv:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.token, max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="plain", messages=MESSAGES)
        assert e.value.body["param"] == "messages"
        assert "no chat template" in e.value.body["message"]
        assert c.completions.create(model="plain", prompt="x", max_tokens=1).choices


# ---- /v1/models -----------------------------------------------------------------------


def test_models_list_the_base_and_every_experiment(client, server, base) -> None:
    wait_until(lambda: client.models.retrieve(EXP).model_extra["step"] >= 1, timeout=60)
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {base, EXP}
    assert models[base].owned_by == "loraplex" and models[base].model_extra["parent"] is None
    exp = models[EXP].model_extra
    assert exp["parent"] == base and exp["phase"] == "Running" and exp["step"] >= 1
    assert client.models.retrieve(base).id == base
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("default.nope")


# ---- litellm --------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::UserWarning")  # litellm's own pydantic models
def test_litellm_text_completion_and_chat(server) -> None:
    common = {"api_base": f"{server.url}/v1", "api_key": server.token, "max_tokens": 4}
    r = litellm.text_completion(model=f"openai/{EXP}", prompt="say", **common)
    assert r.choices[0].text is not None and r.usage.completion_tokens <= 4
    r = litellm.completion(model=f"openai/{EXP}", messages=MESSAGES, **common)
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens <= 4
    chunks = list(
        litellm.completion(model=f"openai/{EXP}", messages=MESSAGES, stream=True, **common)
    )
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")


# ---- the vllm rollout backend ---------------------------------------------------------


def test_the_vllm_backend_serves_the_openai_routes(tmp_path: Path) -> None:
    """Same routes through vLLM (docs/engine-api.md: whole rows, so a stream's chunks
    come when the row is done)."""
    skip_without_vllm()
    from loraplex_engine.dev.tiny_model import build_model

    model = build_model(tmp_path / "tiny-vllm-chat", preset="tiny-vllm")
    srv = EngineServer(
        model,
        tmp_path / "ckpt",
        workdir=tmp_path,
        max_adapters=1,
        max_rank=8,
        rollout_backend="vllm",
        env={"LORAPLEX_VLLM_PYTHON": str(VLLM_PYTHON)},
        extra_args=["--vllm-option", "max_model_len=256"],
        ready_timeout=600,
    )
    with srv:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.token, max_retries=0)
        name = "tiny-vllm-chat"
        kw = {"model": name, "prompt": "hello", "max_tokens": 12}
        greedy = c.completions.create(temperature=0, logprobs=0, **kw)
        text = greedy.choices[0].text
        assert greedy.usage.completion_tokens == len(greedy.choices[0].logprobs.token_logprobs)
        assert c.completions.create(temperature=2.0, top_p=1e-6, **kw).choices[0].text == text
        seeded = [c.completions.create(seed=5, n=2, **kw) for _ in range(2)]
        assert [x.text for x in seeded[0].choices] == [x.text for x in seeded[1].choices]
        streamed = c.completions.create(temperature=0, stream=True, **kw)
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == text
        if len(text) > 3:
            stop = text[2:4]
            cut = c.completions.create(temperature=0, stop=stop, **kw).choices[0]
            assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"
        alts = c.completions.create(temperature=0, logprobs=2, **kw).choices[0].logprobs
        assert len(alts.top_logprobs) == len(alts.token_logprobs) == len(alts.tokens)
        for token_lp, top in zip(alts.token_logprobs, alts.top_logprobs, strict=True):
            # vLLM's own log-probs (its CPU build's greedy pick is not always their top)
            assert 1 <= len(top) <= 2 and token_lp <= 0 and all(v <= 0 for v in top.values())
        chat = {"model": name, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
        reply = c.chat.completions.create(**chat).choices[0].message.content
        chunks = c.chat.completions.create(stream=True, **chat)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == reply
        assert [m.id for m in c.models.list()] == [name]
