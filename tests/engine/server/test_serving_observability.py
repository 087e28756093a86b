"""A real ``loraplex-engine serve --log-format json`` with serving traffic: its scrape
passes ``promtool check metrics`` (no ``_created`` series, histograms well formed), the
serving series count what was sent, and its log is one JSON object per line with an
access line per request, no library INFO chatter and no secret.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server_process import EngineServer
from tests.support.server_specs import small_spec

REPO = Path(__file__).resolve().parents[3]
PROMTOOL = REPO / ".tools" / "bin" / "promtool"
QUIET_LIBRARIES = ("httpx", "httpcore", "urllib3", "transformers", "uvicorn.access")


def _promtool() -> Path:
    if not PROMTOOL.exists():
        pytest.fail(f"promtool is not installed at {PROMTOOL}: run `make tools`", pytrace=False)
    return PROMTOOL


def test_a_served_engine_scrapes_clean_and_logs_json(tiny_model_dir: Path, tmp_path: Path) -> None:
    promtool = _promtool()
    srv = EngineServer(
        tiny_model_dir, tmp_path / "ckpt", workdir=tmp_path, extra_args=["--log-format", "json"]
    )
    with srv, srv.client() as c:
        spec = small_spec(max_steps=2)
        body = {"spec": spec, "namespace": "team-a", "name": "serve"}
        assert c.put("/v1/experiments/team-a.serve", json=body).status_code == 201
        base = c.get("/v1/models").json()["data"][0]["id"]
        for model, stream in (("team-a.serve", False), ("team-a.serve", True), (base, False)):
            r = c.post(
                "/v1/completions",
                json={"model": model, "prompt": "a b", "max_tokens": 3, "stream": stream},
                headers={"X-Request-ID": f"req-{model}-{stream}"},
            )
            assert r.status_code == 200, r.text
        assert (
            c.post("/v1/completions", json={"model": "no.such", "prompt": "x"}).status_code == 404
        )
        refused = httpx.post(f"{srv.url}/v1/completions", json={"model": base, "prompt": "x"})
        assert refused.status_code == 401
        scrape = c.get("/metrics").text
    check = subprocess.run(
        [str(promtool), "check", "metrics"],
        input=scrape,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "_created" not in scrape

    series = {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(scrape)
        for sample in family.samples
    }

    def value(name: str, **labels: str) -> float | None:
        return series.get((name, frozenset(labels.items())))

    exp = {"namespace": "team-a", "experiment": "team-a.serve"}
    assert value("loraplex_engine_serving_requests_total", **exp) == 2
    assert value("loraplex_engine_serving_first_token_seconds_count", **exp) == 2
    assert value("loraplex_engine_serving_requests_total", namespace="", experiment=base) == 1
    other = {"namespace": "", "experiment": "other"}
    assert value("loraplex_engine_serving_errors_total", **other, code="not_found") == 1
    assert value("loraplex_engine_serving_errors_total", **other, code="unauthorized") == 1
    assert value("loraplex_engine_serving_queue_depth") == 0

    lines = [line for line in srv.log_text().splitlines() if line.strip()]
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            pytest.fail(f"a log line that is not JSON: {line!r}")
    for record in records:
        assert {"time", "level", "logger", "message"} <= set(record), record
    assert any("loraplex-engine ready:" in r["message"] for r in records)
    chatter = [r for r in records if r["logger"].startswith(QUIET_LIBRARIES)]
    assert not [r for r in chatter if r["level"] in ("DEBUG", "INFO")], chatter[:3]
    access = [r for r in records if r["logger"] == "loraplex_engine.access"]
    streamed = [r for r in access if r.get("request_id") == "req-team-a.serve-True"]
    assert len(streamed) == 1, access
    assert streamed[0]["method"] == "POST" and streamed[0]["path"] == "/v1/completions"
    assert streamed[0]["status"] == 200 and streamed[0]["duration_ms"] > 0
    assert [r["status"] for r in access if r["status"] == 401] == [401]
    text = "\n".join(lines)
    assert srv.token not in text and "Bearer" not in text
