"""The engine server as the operator sees it: a real `loraplex-engine serve` process
with the tiny model on 127.0.0.1, driven over HTTP only (no fakes).

One server for the module (model loading is the expensive part); the tests run in
file order and share its experiments: three train concurrently from the first test on.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from loraplex_engine.server.app import create_app
from loraplex_engine.server.holder import EngineHolder
from prometheus_client.parser import text_string_to_metric_families

from tests.support.app_routes import v1_routes
from tests.support.server_process import EngineServer, record_measurement, wait_until
from tests.support.server_specs import put_body, small_spec

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
THREE = ("default.say-yes", "default.say-no", "team-b.say-sum")
TARGETS = {"default.say-yes": "yes", "default.say-no": "no", "team-b.say-sum": "sum"}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("live")
    # --max-registered 4: the engine is full at its four slots (no paging), see below.
    srv = EngineServer(
        tiny_model_dir, work / "ckpt", max_adapters=4, max_rank=16, workdir=work,
        extra_args=["--max-registered", "4"],
    )  # fmt: skip
    srv.start()
    record_measurement("startup_s_cold", srv.startup_s, "process start -> /readyz 200 (test)")
    record_measurement("startup_s_server_reported", srv.reported_startup_s, "server's own")
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def api(server: EngineServer):
    with server.client() as c:
        yield c


def status(api: httpx.Client, exp_id: str) -> dict[str, Any]:
    r = api.get(f"/v1/experiments/{exp_id}")
    assert r.status_code == 200, r.text
    return r.json()


def steps(api: httpx.Client) -> dict[str, int]:
    return {s["id"]: s["step"] for s in api.get("/v1/experiments").json()["experiments"]}


def tick_and_step_counts(server: EngineServer) -> tuple[float, dict[str, float]]:
    """Ticks and per-experiment steps from one /metrics scrape.

    Both are fed by the same tick report under one lock, so a single scrape sees them
    at most one tick apart (the scrape is not atomic across families). Experiment
    status is read under a different lock and can run a tick or two ahead of the tick
    count, so it is not compared with it.
    """
    ticks, step_counts = None, {}
    scrape = httpx.get(f"{server.url}/metrics", headers=server.headers).text
    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            if sample.name == "loraplex_engine_tick_seconds_count":
                ticks = sample.value
            elif sample.name == "loraplex_engine_steps_total":
                step_counts[sample.labels["experiment"]] = sample.value
    assert ticks is not None, "no tick count in /metrics"
    return ticks, step_counts


def test_three_experiments_train_concurrently(server: EngineServer, api: httpx.Client) -> None:
    for i, exp_id in enumerate(THREE):
        t_put = time.monotonic()
        r = api.put(
            f"/v1/experiments/{exp_id}", json=put_body(exp_id, small_spec(TARGETS[exp_id], seed=i))
        )
        assert r.status_code == 201, r.text
        assert r.json()["phase"] == "Running" and r.json()["step"] == 0
        if i == 0:  # the engine was idle: PUT -> first step is one tick
            wait_until(lambda: status(api, THREE[0])["step"] >= 1, timeout=60)
            record_measurement(
                "put_to_first_step_s_idle_engine",
                time.monotonic() - t_put,
                "PUT -> step 1, warm idle engine",
            )

    wait_until(lambda: min(steps(api).get(e, 0) for e in THREE) >= 3, timeout=120)
    # Concurrent, not one after another: every tick steps all three.
    ticks0, before = tick_and_step_counts(server)

    def advanced_three() -> bool:
        return all(tick_and_step_counts(server)[1][e] >= before[e] + 3 for e in THREE)

    wait_until(advanced_three, timeout=120)
    ticks1, after = tick_and_step_counts(server)
    ticks = ticks1 - ticks0
    assert ticks >= 3
    for e in THREE:  # one tick of slack per scrape
        assert after[e] - before[e] >= ticks - 2, (e, before, after, ticks)
    listed = {s["id"]: s for s in api.get("/v1/experiments").json()["experiments"]}
    assert set(THREE) <= set(listed)
    for e in THREE:
        s = listed[e]
        assert s["phase"] == "Running" and s["error"] is None
        assert s["reward"] is not None and 0.0 <= s["reward"] <= 1.0
        assert s["rolloutTokens"] > 0 and s["trainTokens"] > 0
        assert s["checkpoint"] is not None and s["checkpoint"]["step"] >= 2

    cap = api.get("/v1/capacity").json()
    assert cap["usedSlots"] == 3 and cap["freeSlots"] == 1 and cap["maxRank"] == 16
    assert sorted(cap["experiments"]) == sorted(THREE)
    assert cap["memory"]["rssBytes"] > 0

    # A fourth joins three running ones: time to its first step on a busy warm engine.
    t_put = time.monotonic()
    r = api.put(
        "/v1/experiments/default.fourth", json=put_body("default.fourth", small_spec(seed=9))
    )
    assert r.status_code == 201, r.text
    wait_until(lambda: status(api, "default.fourth")["step"] >= 1, timeout=60)
    record_measurement(
        "put_to_first_step_s_busy_engine",
        time.monotonic() - t_put,
        "PUT -> step 1 while three others train",
    )


# Series only an engine with the vLLM rollout backend exports (docs/metrics.md says so).
VLLM_ONLY = {"loraplex_engine_logprob_gap"}


def test_metrics_parse_and_carry_every_experiment(api: httpx.Client) -> None:
    r = api.get("/metrics")  # every series: the token (open, the engine's own alone)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    documented = _documented_engine_metrics()
    assert len(documented) == 40  # a new series: document it in docs/metrics.md
    for name, kind in documented.items():
        if name in VLLM_ONLY:  # this engine rolls out with torch (test_server_vllm.py has it)
            continue
        if name.startswith("loraplex_engine_tracking_"):  # no tracker here: test_tracking_live
            continue
        family_name = name.removesuffix("_total") if kind == "counter" else name
        assert family_name in families, f"{name} missing from /metrics"
        assert families[family_name].type == kind, name

    def value(name: str, **labels: str) -> float:
        for s in families[name.removesuffix("_total").removesuffix("_count")].samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
        raise AssertionError(f"no sample {name} {labels}")

    for e in THREE:
        ns = e.split(".")[0]
        assert value("loraplex_engine_steps_total", namespace=ns, experiment=e) >= 3
        assert value("loraplex_engine_rollout_tokens_total", namespace=ns, experiment=e) > 0
        assert value("loraplex_engine_train_tokens_total", namespace=ns, experiment=e) > 0
        assert value("loraplex_engine_checkpoints_total", namespace=ns, experiment=e) >= 1
        assert 0.0 <= value("loraplex_engine_reward", namespace=ns, experiment=e) <= 1.0
    assert value("loraplex_engine_active_adapters") == 4
    assert value("loraplex_engine_free_slots") == 0
    assert value("loraplex_engine_memory_bytes", kind="rss") > 0
    assert value("loraplex_engine_tick_seconds_count") >= 5
    for phase in ("rollout", "reward", "train", "sync", "checkpoint"):
        assert value("loraplex_engine_phase_seconds_count", phase=phase) >= 5
    assert 0.0 < value("loraplex_engine_busy_ratio") <= 1.0


def test_completions_come_from_the_current_adapter(api: httpx.Client) -> None:
    # The tiny model's adapter moves only once a rollout scores above zero, which is
    # chance: say-no's seed scores from step 6 (say-yes's only from step 24). An
    # experiment's samples depend on its own seed alone, so this does not vary by run.
    exp = "default.say-no"
    wait_until(lambda: status(api, exp)["step"] >= 10, timeout=120)
    base = api.get("/v1/capacity").json()["model"]
    prompts = ["the answer say yes:", "copy of say yes:", "sum token say", "repeat is"]
    body = {"prompt": prompts, "max_tokens": 6, "temperature": 0.0}
    step_before = status(api, exp)["step"]
    trained = api.post("/v1/completions", json={**body, "model": exp})
    assert trained.status_code == 200, trained.text
    out = trained.json()
    assert out["object"] == "text_completion" and out["model"] == exp
    assert out["id"].startswith("cmpl-") and isinstance(out["created"], int)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert all(c["finish_reason"] in ("stop", "length") for c in out["choices"])
    usage = out["usage"]
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    untrained = api.post("/v1/completions", json={**body, "model": base})
    assert untrained.status_code == 200, untrained.text
    texts = [c["text"] for c in out["choices"]]
    base_texts = [c["text"] for c in untrained.json()["choices"]]
    assert texts != base_texts, (texts, base_texts)
    # Greedy decoding of the same adapter is repeatable while... the adapter moves on, so
    # only check that sampling n > 1 gives n choices.
    r = api.post("/v1/completions", json={"model": exp, "prompt": "say", "n": 3, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    # Training went on while we were served.
    wait_until(lambda: status(api, exp)["step"] > step_before, timeout=60)


def test_bad_requests_get_4xx_json_naming_the_problem(api: httpx.Client) -> None:
    def error(r: httpx.Response, code: int) -> dict[str, Any]:
        assert r.status_code == code, r.text
        assert r.headers["content-type"] == "application/json"
        return r.json()["error"]

    url = "/v1/experiments/default.extra"
    e = error(
        api.put(url, content=b'{"spec": {"lora": ', headers={"content-type": "application/json"}),
        400,
    )
    assert e["code"] == "invalid_json" and "JSON" in e["message"]

    e = error(api.put(url, json={**put_body("default.extra", small_spec()), "color": "red"}), 422)
    assert e == {
        "code": "invalid_request",
        "field": "color",
        "message": "color: unknown field",
        "type": "invalid_request_error",
        "param": "color",
    }

    spec = small_spec()
    spec["lora"]["ranq"] = 4
    e = error(api.put(url, json=put_body("default.extra", spec)), 422)
    assert e["code"] == "invalid_spec" and e["field"] == "spec.lora.ranq"
    assert "unknown field" in e["message"]

    spec = small_spec()
    spec["algorithm"]["groupSize"] = "many"
    e = error(api.put(url, json=put_body("default.extra", spec)), 422)
    assert e["code"] == "invalid_spec" and e["field"] == "spec.algorithm.groupSize"

    e = error(api.put(url, json=put_body("default.extra", small_spec(rank=64))), 422)
    assert e["code"] == "invalid_spec" and e["field"] == "spec.lora.rank"
    assert "64" in e["message"] and "16" in e["message"]

    e = error(api.put("/v1/experiments/Bad_Id", json=put_body("default.x", small_spec())), 422)
    assert e["field"] == "id"

    # All four slots are taken (three + default.fourth).
    e = error(api.put(url, json=put_body("default.extra", small_spec())), 409)
    assert e["code"] == "no_capacity"

    other = small_spec("yes", seed=0)
    other["algorithm"]["learningRate"] = 0.001
    e = error(
        api.put("/v1/experiments/default.say-yes", json=put_body("default.say-yes", other)), 409
    )
    assert e["code"] == "conflict" and "different spec" in e["message"]
    same = api.put(
        "/v1/experiments/default.say-yes",
        json=put_body("default.say-yes", small_spec("yes", seed=0)),
    )
    assert same.status_code == 200 and same.json()["id"] == "default.say-yes"

    for method, path in (
        ("GET", "/v1/experiments/default.nope"),
        ("DELETE", "/v1/experiments/default.nope"),
        ("POST", "/v1/experiments/default.nope/checkpoint"),
    ):
        e = error(api.request(method, path), 404)
        assert e["code"] == "not_found" and "default.nope" in e["message"]

    e = error(api.post("/v1/completions", json={"model": "default.nope", "prompt": "x"}), 404)
    assert e["code"] == "not_found"
    # The OpenAI routes answer a bad request 400, as OpenAI does.
    e = error(
        api.post("/v1/completions", json={"model": "default.say-yes", "prompt": "x", "n": 99}), 400
    )
    assert e["field"] == e["param"] == "n"
    e = error(
        api.post(
            "/v1/completions",
            json={"model": "default.say-yes", "prompt": "x", "presence_penalty": 1.0},
        ),
        400,
    )
    assert e["field"] == "presence_penalty"

    # Free a slot, then a resumeFrom that is no checkpoint.
    assert api.delete("/v1/experiments/default.fourth").status_code == 200
    e = error(
        api.put(url, json=put_body("default.extra", small_spec(), "/nonexistent/step-00000002")),
        422,
    )
    assert e["code"] == "bad_checkpoint" and e["field"] == "resumeFrom"
    assert "default.extra" not in steps(api)

    # The engine kept serving everyone else.
    before = steps(api)
    wait_until(lambda: all(steps(api)[x] > before[x] for x in THREE), timeout=60)


def test_every_v1_route_refuses_a_missing_or_wrong_token(server: EngineServer) -> None:
    # Routes come from the app itself, so a route added later is covered automatically.
    routes = v1_routes(create_app(EngineHolder("x", "torch"), "t"))
    assert {p for _, p in routes} >= {
        "/v1/capacity",
        "/v1/experiments",
        "/v1/experiments/{id}",
        "/v1/experiments/{id}/checkpoint",
        "/v1/completions",
    }
    with server.client() as ok:
        before = {s["id"]: s["phase"] for s in ok.get("/v1/experiments").json()["experiments"]}
    bad_headers = (
        {},
        {"Authorization": "Bearer wrong-token"},
        {"Authorization": f"Basic {server.token}"},
        {"Authorization": server.token},
        {"Authorization": f"Bearer {server.token}x"},
    )
    bodies = {
        "PUT": put_body("default.sneaky", small_spec()),
        "POST": {"model": "default.say-yes", "prompt": "x"},
    }
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        for method, path in [*routes, ("GET", "/v1/not-a-route")]:
            url = path.replace("{id}", "default.say-no")
            for headers in bad_headers:
                r = anon.request(method, url, headers=headers, json=bodies.get(method))
                assert r.status_code == 401, (method, url, headers, r.text)
                assert r.json()["error"]["code"] == "unauthorized"
                assert r.headers["www-authenticate"] == "Bearer"
        for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
            assert anon.get(path).status_code == 200, path
    with server.client() as ok:
        after = {s["id"]: s["phase"] for s in ok.get("/v1/experiments").json()["experiments"]}
    assert after == before  # nothing deleted, nothing added


def test_delete_checkpoints_unloads_and_drops_series(
    server: EngineServer, api: httpx.Client
) -> None:
    exp = "team-b.say-sum"
    r = api.delete(f"/v1/experiments/{exp}")
    assert r.status_code == 200, r.text
    final = r.json()
    assert final["checkpoint"]["step"] == final["step"] > 0
    ckpt = Path(final["checkpoint"]["path"])
    assert ckpt.parent == server.checkpoint_root / "team-b" / "say-sum" / final["runId"]
    assert re.fullmatch(r"step-\d{8}", ckpt.name)
    for f in (
        "adapter_config.json",
        "adapter_model.safetensors",
        "trainer_state.json",
        "optimizer.safetensors",
    ):
        assert (ckpt / f).is_file(), f
    assert api.get(f"/v1/experiments/{exp}").status_code == 404
    assert exp not in api.get("/v1/capacity").json()["experiments"]
    text = httpx.get(f"{server.url}/metrics", headers=server.headers).text
    assert f'experiment="{exp}"' not in text
    assert 'experiment="default.say-yes"' in text


def _documented_engine_metrics() -> dict[str, str]:
    """name -> type from the engine table of docs/metrics.md."""
    text = (REPO / "docs" / "metrics.md").read_text()
    section = text.split("## Engine", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(loraplex_engine_\w+)` \| (\w+) \|", section, re.M))
