"""In-process tests of the HTTP layer and the metrics, against a fake EngineService.

Why a fake here: these tests pin down the translation layer itself (error mapping,
validation messages, auth on every route, 503 while loading, metrics bookkeeping, the
loop's idle wait and error budget) in milliseconds, including states a real engine
reaches only rarely (a tick raising, an engine that never finishes loading). The
behaviour a client sees from the real engine is covered by test_server_live.py,
test_server_crash.py and test_server_fuzz.py, which run `loraplex-engine serve` with
the tiny model and no fakes.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from loraplex_engine.metrics import EngineMetrics
from loraplex_engine.server.app import create_app
from loraplex_engine.server.holder import EngineHolder
from loraplex_engine.server.serve import EngineLoop
from loraplex_engine.spec.api_types import ExperimentTick, TickReport
from prometheus_client.parser import text_string_to_metric_families

from tests.support.app_client import AUTH, TOKEN, put
from tests.support.app_routes import v1_routes
from tests.support.fake_engine import FakeEngine
from tests.support.server_specs import small_spec

SPEC = {"lora": {"rank": 4}, "task": {"name": "target-token"}}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine):
    from fastapi.testclient import TestClient

    metrics = EngineMetrics()
    app = create_app(engine, TOKEN, metrics=metrics)
    with TestClient(app, raise_server_exceptions=False) as c:
        c.metrics = metrics  # type: ignore[attr-defined]
        yield c


def test_put_is_idempotent_and_conflicts_on_a_different_spec(client) -> None:
    r = put(client, "default.a")
    assert r.status_code == 201, r.text
    assert r.json()["id"] == "default.a" and r.json()["phase"] == "Running"
    assert put(client, "default.a").status_code == 200
    other = small_spec(rank=4)
    other["lora"] = {**other["lora"], "rank": 2}
    r = put(client, "default.a", spec=other)
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"


def test_run_id_reaches_the_engine_and_comes_back_in_the_status(client) -> None:
    r = put(client, "default.a", runId="0b7c6d2e-5f1a-4c3b-9e8d-7a6b5c4d3e2f")
    assert r.status_code == 201, r.text
    assert r.json()["runId"] == "0b7c6d2e-5f1a-4c3b-9e8d-7a6b5c4d3e2f"
    got = client.get("/v1/experiments/default.a", headers=AUTH).json()
    assert got["runId"] == "0b7c6d2e-5f1a-4c3b-9e8d-7a6b5c4d3e2f"
    assert put(client, "default.b", runId=None).json()["runId"] == "made-by-engine"


@pytest.mark.parametrize("run_id", ["", "../x", "a/b", ".a", "-a", "a" * 65, "a b", 5, True])
def test_a_bad_run_id_is_refused_naming_the_field(client, engine, run_id) -> None:
    r = put(client, "default.a", runId=run_id)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["code"], err["field"]) == ("invalid_request", "runId")
    assert err["message"].startswith("runId: ")
    assert engine.calls == []


def test_errors_are_json_and_name_the_problem(client) -> None:
    r = client.put(
        "/v1/experiments/default.a",
        content=b'{"spec": {',
        headers={**AUTH, "content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = put(client, "default.a", bogus=1)
    assert r.status_code == 422
    assert r.json()["error"] == {
        "code": "invalid_request",
        "field": "bogus",
        "message": "bogus: unknown field",
        "type": "invalid_request_error",  # OpenAI's keys beside the engine's
        "param": "bogus",
    }
    r = client.put("/v1/experiments/Not_An_Id", json={}, headers=AUTH)
    assert r.status_code == 422 and r.json()["error"]["field"] == "id"
    r = client.get("/v1/experiments/default.nope", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.get("/v1/nowhere", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.patch("/v1/capacity", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = client.post("/v1/completions", json={"model": "x", "prompt": "hi", "n": 0}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["field"] == "n"
    r = client.post(
        "/v1/completions", json={"model": "x", "prompt": "hi", "max_tokens": 10**6}, headers=AUTH
    )
    assert r.status_code == 400 and r.json()["error"]["field"] == "max_tokens"
    r = client.post("/v1/completions", json={"model": "x", "prompt": ["a", 3]}, headers=AUTH)
    assert r.status_code == 400 and "prompt[1]: Input should be a valid string" in r.text
    r = client.post(
        "/v1/completions", json={"model": "x", "prompt": ["a"] * 5, "n": 16}, headers=AUTH
    )
    assert r.status_code == 400 and r.json()["error"]["field"] == "n"
    r = client.post("/v1/completions", json={"model": "x", "prompt": "a", "n": True}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["field"] == "n"  # no coercion
    r = client.put(
        "/v1/experiments/default.a",
        content=b"",
        headers={**AUTH, "content-type": "application/json"},
    )
    assert r.status_code == 422 and "JSON object body is required" in r.text


def test_oversized_bodies_are_refused_before_parsing(engine: FakeEngine) -> None:
    from fastapi.testclient import TestClient

    c = TestClient(create_app(engine, TOKEN, max_body_bytes=1000))
    big = {"model": "fake-base", "prompt": "x" * 2000}
    r = c.post("/v1/completions", json=big, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"

    def chunks():
        yield b'{"model": "fake-base", "prompt": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'"}'

    r = c.post(
        "/v1/completions",
        content=chunks(),
        headers={**AUTH, "content-type": "application/json"},
    )
    assert r.status_code in (400, 413) and "error" in r.json()
    assert c.post("/v1/completions", json=big).status_code == 401  # the token comes first
    assert engine.calls == []


def test_rank_and_capacity_errors_come_from_the_engine(client) -> None:
    spec = small_spec(rank=4)
    spec["lora"] = {**spec["lora"], "rank": 64}
    r = put(client, "default.big", spec=spec)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "invalid_spec"
    assert r.json()["error"]["field"] == "spec.lora.rank"
    assert put(client, "default.a").status_code == 201
    assert put(client, "default.b").status_code == 201
    r = put(client, "default.c")
    assert r.status_code == 409 and r.json()["error"]["code"] == "no_capacity"


def test_every_v1_route_needs_the_token(client, engine: FakeEngine) -> None:
    routes = v1_routes(client.app)
    assert len(routes) >= 7
    for method, path in routes:
        url = path.replace("{id}", "default.a")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            r = client.request(method, url, headers=headers, json={"x": 1})
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.json()["error"]["code"] == "unauthorized"
    assert engine.calls == []
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        assert client.get(path).status_code == 200, path


def test_completions_are_openai_shaped(client) -> None:
    assert put(client, "default.a").status_code == 201
    r = client.post(
        "/v1/completions",
        json={"model": "default.a", "prompt": ["x y", "z"], "max_tokens": 4, "n": 2},
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "default.a"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][2]["text"] == "default.a:z:0"
    assert body["choices"][2]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == 4  # "x y" and "z": the fake's ids
    assert body["usage"]["completion_tokens"] == sum(len(c["text"]) for c in body["choices"])
    assert body["usage"]["total_tokens"] == 4 + body["usage"]["completion_tokens"]
    r = client.post("/v1/completions", json={"model": "nope", "prompt": "x"}, headers=AUTH)
    assert r.status_code == 404


def test_metrics_follow_ticks_and_drop_unloaded_experiments(client, engine) -> None:
    assert put(client, "default.a").status_code == 201
    assert put(client, "default.b").status_code == 201
    for _ in range(3):
        client.metrics.observe_tick(engine.tick())
    # without the token the engine's own series alone: no tenant label (metrics_access.py)
    open_samples = _samples(client.get("/metrics").text)
    assert open_samples[("loraplex_engine_free_slots", ())] == 0
    assert not any("default.a" in labels for _, labels in open_samples)
    samples = _samples(client.get("/metrics", headers=AUTH).text)
    assert samples[("loraplex_engine_steps_total", ("default.a", "default"))] == 3
    assert samples[("loraplex_engine_train_tokens_total", ("default.b", "default"))] == 60
    assert samples[("loraplex_engine_active_adapters", ())] == 2
    assert samples[("loraplex_engine_free_slots", ())] == 0
    assert 0 < samples[("loraplex_engine_busy_ratio", ())] <= 1
    assert client.delete("/v1/experiments/default.a", headers=AUTH).status_code == 200
    samples = _samples(client.get("/metrics", headers=AUTH).text)
    assert not any("default.a" in labels for _, labels in samples)
    assert ("loraplex_engine_steps_total", ("default.b", "default")) in samples


def test_failures_count_by_reason() -> None:
    m = EngineMetrics()
    m.observe_tick(
        TickReport(0.1, {}, [ExperimentTick("x.a", "x", 3, 0.0, 0, 0, failed_reason="nan")])
    )
    samples = _samples(m.render().decode())
    assert samples[("loraplex_engine_experiment_failures_total", ("nan",))] == 1
    assert ("loraplex_engine_steps_total", ("x.a", "x")) in samples  # created, not stepped


def test_busy_ratio_is_the_share_of_the_last_minute() -> None:
    now = [1000.0]
    m = EngineMetrics(clock=lambda: now[0])
    now[0] += 30.0
    m.observe_tick(TickReport(15.0, {}))
    assert m.compute_busy_ratio() == pytest.approx(0.5)
    now[0] += 60.0
    assert m.compute_busy_ratio() == 0.0


def test_503_while_loading_then_ready() -> None:
    from fastapi.testclient import TestClient

    holder = EngineHolder("fake-base", "torch")
    app = create_app(holder, TOKEN)
    with TestClient(app) as c:
        assert c.get("/healthz").status_code == 200
        assert c.get("/readyz").status_code == 503
        r = c.get("/v1/capacity", headers=AUTH)
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        holder.engine = FakeEngine()
        assert c.get("/readyz").status_code == 200
        assert c.get("/v1/capacity", headers=AUTH).json()["model"] == "fake-base"


def test_loop_sleeps_when_idle_and_wakes_on_work() -> None:
    engine = FakeEngine()
    calls = []
    real_tick = engine.tick

    def counting_tick():
        calls.append(time.monotonic())
        return real_tick()

    engine.tick = counting_tick  # type: ignore[method-assign]
    loop = EngineLoop(engine, EngineMetrics(), idle_wait_s=30.0)
    loop.start()
    try:
        _until(lambda: len(calls) >= 1)
        idle_calls = len(calls)
        time.sleep(0.2)  # an idle loop must not spin
        assert len(calls) == idle_calls
        engine.put_experiment("default.a", SPEC, "default", "a", None)
        loop.wake()
        _until(lambda: engine.get_experiment("default.a").step >= 3)
    finally:
        loop.stop(5)
    assert not loop.running


def test_loop_survives_a_few_tick_errors_but_not_endless_ones() -> None:
    engine = FakeEngine()
    engine.put_experiment("default.a", SPEC, "default", "a", None)
    engine.fail_ticks = 2
    loop = EngineLoop(engine, EngineMetrics(), max_errors=3)
    loop.start()
    _until(lambda: engine.get_experiment("default.a").step >= 2)
    assert not loop.failed
    engine.fail_ticks = 10**6
    _until(lambda: loop.failed)
    loop.stop(5)


def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def _samples(text: str) -> dict[tuple[str, tuple[str, ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "le" in s.labels:
                continue
            labels = tuple(s.labels[k] for k in sorted(s.labels))  # (experiment, namespace)
            out[(s.name, labels)] = s.value
    return out


# The GRPO family's settings (spec/algorithm.py), one case per validation rule: a bad
# value is a 422 naming the field, before the engine is asked anything.
BAD_ALGORITHM = [
    ({"clipHigh": 1.28}, "spec.algorithm.clipHigh", "less than or equal to 1"),
    ({"clipHigh": 0}, "spec.algorithm.clipHigh", "greater than 0"),
    ({"clipHigh": 0.1}, "spec.algorithm.clipHigh", "must be at least algorithm.clip"),
    ({"importanceSamplingLevel": "seq"}, "spec.algorithm.importanceSamplingLevel", "'token'"),
    ({"advantageEstimator": "ppo"}, "spec.algorithm.advantageEstimator", "'rloo'"),
    ({"scaleRewards": "std"}, "spec.algorithm.scaleRewards", "'batch'"),
    ({"lossAggregation": "dr_grpo"}, "spec.algorithm.lossAggregation", "'token-mean'"),
    ({"klEstimator": "k2"}, "spec.algorithm.klEstimator", "'k3'"),
    ({"dynamicSampling": "yes"}, "spec.algorithm.dynamicSampling", "boolean"),
    ({"overlong": {}}, "spec.algorithm.overlong.bufferTokens", "Field required"),
    ({"overlong": {"bufferTokens": 0}}, "spec.algorithm.overlong.bufferTokens", "greater than"),
    ({"overlong": {"bufferTokens": 2, "penalty": 0}}, "spec.algorithm.overlong.penalty", "greater"),
    ({"overlong": {"bufferTokens": 2, "cache": 1}}, "spec.algorithm.overlong.cache", "unknown"),
    ({"overlong": {"bufferTokens": 5}}, "spec.algorithm.overlong.bufferTokens", "rollout.maxNew"),
]


@pytest.mark.parametrize(("algorithm", "field", "words"), BAD_ALGORITHM)
def test_a_bad_grpo_family_setting_is_a_422_naming_it(
    client, engine: FakeEngine, algorithm: dict[str, Any], field: str, words: str
) -> None:
    spec = small_spec(rank=4)  # rollout.maxNewTokens 4
    spec["algorithm"] = {**spec["algorithm"], **algorithm}
    r = put(client, "default.a", spec=spec)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["code"], err["field"]) == ("invalid_spec", field)
    assert words in err["message"]
    assert engine.calls == []
