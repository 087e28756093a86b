"""The serving metrics of the OpenAI routes, the request id and the access log
(server/observe.py, metrics.py), on the HTTP app with a fake engine.

The same on a real ``serve`` process, with its scrape through ``promtool check metrics``
and its JSON log read line by line: test_serving_observability.py.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient
from loraplex_engine.metrics import OTHER_MODEL, EngineMetrics
from loraplex_engine.server.app import create_app
from loraplex_engine.spec.errors import UnavailableError
from prometheus_client.parser import text_string_to_metric_families

from tests.support.app_client import AUTH, TOKEN, put
from tests.support.fake_engine import FakeEngine

BASE = FakeEngine.model_name


class QueueingEngine(FakeEngine):
    """Reports completions waiting for a tick; ``broken`` fails its completions inside
    the engine (after a stream has begun)."""

    queued_completions = 3
    broken: str | None = None

    def complete(self, job: Any) -> Any:
        if job.model == self.broken:
            raise UnavailableError("the tick serving this failed: RuntimeError")
        return super().complete(job)


@pytest.fixture
def served() -> Any:
    engine = QueueingEngine()
    metrics = EngineMetrics()
    app = create_app(engine, TOKEN, metrics=metrics)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c, engine, metrics


def _series(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _value(series: dict, name: str, **labels: str) -> float | None:
    return series.get((name, frozenset(labels.items())))


def _complete(client: TestClient, model: str, **extra: Any) -> Any:
    body = {"model": model, "prompt": "hi", "max_tokens": 4, **extra}
    return client.post("/v1/completions", json=body, headers=AUTH)


def test_serving_requests_latency_and_errors_by_experiment(served) -> None:
    client, _, _ = served
    assert put(client, "default.a").status_code == 201
    assert _complete(client, "default.a").status_code == 200
    stream = _complete(client, "default.a", stream=True)
    assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n")
    chat = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=chat, headers=AUTH).status_code == 200
    assert _complete(client, "team-x.unknown").status_code == 404  # no such model: "other"
    assert _complete(client, "default.a", suffix="no").status_code == 400  # body refused
    as_json = {**AUTH, "Content-Type": "application/json"}
    assert client.post("/v1/completions", content=b"{", headers=as_json).status_code == 400
    assert client.post("/v1/completions", json={}).status_code == 401

    s = _series(client.get("/metrics", headers=AUTH).text)
    a = {"namespace": "default", "experiment": "default.a"}
    base = {"namespace": "", "experiment": BASE}
    other = {"namespace": "", "experiment": OTHER_MODEL}
    assert _value(s, "loraplex_engine_serving_requests_total", **a) == 2
    assert _value(s, "loraplex_engine_serving_requests_total", **base) == 1
    assert _value(s, "loraplex_engine_serving_requests_total", **other) == 4
    assert _value(s, "loraplex_engine_serving_request_seconds_count", **a) == 2
    # Time to the first token: only the requests that generated one (streamed or not).
    assert _value(s, "loraplex_engine_serving_first_token_seconds_count", **a) == 2
    assert _value(s, "loraplex_engine_serving_first_token_seconds_count", **base) == 1
    errors = {
        (dict(labels)["experiment"], dict(labels)["code"]): v
        for (name, labels), v in s.items()
        if name == "loraplex_engine_serving_errors_total"
    }
    assert errors == {
        (OTHER_MODEL, "invalid_request"): 1,  # a body refused is no experiment's yet
        (OTHER_MODEL, "not_found"): 1,
        (OTHER_MODEL, "invalid_json"): 1,
        (OTHER_MODEL, "unauthorized"): 1,
    }
    assert _value(s, "loraplex_engine_serving_queue_depth") == 3
    assert not [n for n, _ in s if n.endswith("_created")]

    # Unloaded: its serving series go with its other per-experiment series.
    assert client.delete("/v1/experiments/default.a", headers=AUTH).status_code == 200
    s = _series(client.get("/metrics", headers=AUTH).text)
    assert not [k for k in s if ("experiment", "default.a") in k[1]]
    assert _value(s, "loraplex_engine_serving_requests_total", **base) == 1


def test_a_loaded_experiment_and_the_base_show_at_zero(served) -> None:
    client, _, _ = served
    assert put(client, "default.b").status_code == 201
    s = _series(client.get("/metrics", headers=AUTH).text)
    for labels in ({"namespace": "default", "experiment": "default.b"},
                   {"namespace": "", "experiment": BASE}):  # fmt: skip
        assert _value(s, "loraplex_engine_serving_requests_total", **labels) == 0
        assert _value(s, "loraplex_engine_serving_first_token_seconds_count", **labels) == 0


def test_a_stream_that_fails_after_its_200_counts_its_error_code(served) -> None:
    client, engine, _ = served
    assert put(client, "default.c").status_code == 201
    engine.broken = "default.c"
    r = _complete(client, "default.c", stream=True)
    assert r.status_code == 200 and '"code":"unavailable"' in r.text.replace(" ", "")
    s = _series(client.get("/metrics", headers=AUTH).text)
    labels = {"namespace": "default", "experiment": "default.c", "code": "unavailable"}
    assert _value(s, "loraplex_engine_serving_errors_total", **labels) == 1


def test_the_error_code_label_is_bounded() -> None:
    m = EngineMetrics()
    m.observe_serving("x", 0.1, None, "Not A Code " * 10)
    s = _series(m.render().decode())
    assert _value(
        s, "loraplex_engine_serving_errors_total", namespace="", experiment="other", code="other"
    )


def test_request_id_and_access_log(served, caplog: pytest.LogCaptureFixture) -> None:
    client, _, _ = served
    caplog.set_level(logging.DEBUG, logger="loraplex_engine.access")
    r = client.get("/v1/capacity", headers={**AUTH, "X-Request-ID": "req-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-42"
    r = client.get("/v1/capacity", headers={**AUTH, "X-Request-ID": "bad id\twith junk"})
    generated = r.headers["x-request-id"]
    assert generated != "bad id\twith junk" and len(generated) == 32
    assert client.get("/v1/capacity").status_code == 401
    client.get("/healthz")

    lines = [rec for rec in caplog.records if rec.name == "loraplex_engine.access"]
    first = lines[0]
    assert (first.method, first.path, first.status, first.request_id) == (
        "GET",
        "/v1/capacity",
        200,
        "req-42",
    )
    assert first.levelno == logging.INFO and first.duration_ms >= 0
    assert first.getMessage().startswith("GET /v1/capacity 200 ")
    assert [rec.status for rec in lines[:3]] == [200, 200, 401]
    assert lines[3].path == "/healthz" and lines[3].levelno == logging.DEBUG  # probes: DEBUG
    text = "\n".join(f"{rec.getMessage()} {json.dumps(vars(rec), default=str)}" for rec in lines)
    assert TOKEN not in text and "Bearer" not in text and "authorization" not in text.lower()
