"""Fuzz the live engine server from its own OpenAPI schema (schemathesis + hypothesis).

A real `loraplex-engine serve` with the tiny model, three slots: two experiments train
in the background the whole time, one slot is free for what the fuzzer PUTs. Every
operation gets valid and invalid requests; the checks: never a 5xx, responses match
the documented status codes and schemas, invalid data is rejected. Afterwards the
server is still up and the background experiments are still training.

Bounded: ``LORAPLEX_FUZZ_EXAMPLES`` examples per operation (default 25), derandomized
so CI runs are repeatable. Generated specs that are valid but would make one tick take
minutes (thousands of rollouts, a reward URL that never answers) are scaled down within
their valid range before sending; invalid values are left alone.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis

# Imported at collection, not by the first from_url() inside a test: schemathesis is a pytest
# plugin, so pytest compiles its modules to rewrite their asserts on first import, and in a
# fresh clone's full run CPython 3.11.7's compile() raised "AST constructor recursion depth
# mismatch" there, inside a test, after many earlier tests of the same process.
import schemathesis.specs.openapi.schemas
from hypothesis import HealthCheck, given, settings
from loraplex_engine.server.app import ID_PATTERN, create_app
from loraplex_engine.server.holder import EngineHolder
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.server_process import EngineServer, wait_until
from tests.support.server_specs import put_body, small_spec

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "25"))
BACKGROUND = ("default.bg-one", "team-x.bg-two")
# Within-range caps (schema max in the comment): keep a fuzzed experiment's tick short.
CAPS = {
    "algorithm": {"groupSize": 4, "promptsPerStep": 2, "maxSteps": 3},  # 256, 1024, none
    "rollout": {"maxNewTokens": 4},  # 4096
}
OPENAI_POSTS = ("/v1/completions", "/v1/chat/completions")
SEEN: Counter[tuple[str, int]] = Counter()  # (operation, status) -> responses
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
SCHEMA_MAX = {"groupSize": 256, "promptsPerStep": 1024, "maxSteps": None, "maxNewTokens": 4096}


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("fuzz")
    srv = EngineServer(
        tiny_model_dir,
        work / "ckpt",
        max_adapters=3,
        max_rank=8,
        workdir=work,
        extra_args=["--max-completion-tokens", "8"],
    )
    srv.start()
    with srv.client() as api:
        for i, exp_id in enumerate(BACKGROUND):
            spec = small_spec(seed=i)
            spec["checkpoint"]["everySteps"] = 50
            r = api.put(f"/v1/experiments/{exp_id}", json=put_body(exp_id, spec))
            assert r.status_code == 201, r.text
        wait_until(lambda: all(_step(api, e) >= 1 for e in BACKGROUND), timeout=60)
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def api_schema(fuzz_server: EngineServer):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


def _operations() -> list[str]:
    """Every operation of the app's schema (the same app the server runs)."""
    spec = create_app(EngineHolder("x", "torch"), "t").openapi()
    return [f"{method.upper()} {path}" for path, ops in spec["paths"].items() for method in ops]


def _step(api: httpx.Client, exp_id: str) -> int:
    r = api.get(f"/v1/experiments/{exp_id}")
    assert r.status_code == 200, r.text
    return r.json()["step"]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def tame(body: Any) -> None:
    """Scale a generated spec's cost down, staying inside the schema's valid range."""
    if not isinstance(body, dict) or not isinstance(body.get("spec"), dict):
        return
    spec = body["spec"]
    for section, caps in CAPS.items():
        if section not in spec:  # the defaults (8 x 4 rollouts of 64 tokens) are slow here
            spec[section] = {}
        part = spec.get(section)
        if not isinstance(part, dict):
            continue
        for key, cap in caps.items():
            value, top = part.setdefault(key, cap), SCHEMA_MAX[key]
            if _is_int(value) and value > cap and (top is None or value <= top):
                part[key] = cap
    task = spec.get("task")
    url = task.get("rewardUrl") if isinstance(task, dict) else None
    if isinstance(url, str) and url.startswith(("http://", "https://")):
        task["rewardUrl"] = "http://127.0.0.1:9/score"  # refused at once, never hangs


def match_id(case) -> None:
    """A PUT's id must be the body's `<namespace>.<name>`: make it so for most valid
    bodies, so they reach the engine (the others test the refusal)."""
    body = case.body
    if not isinstance(body, dict) or case.path_parameters is None:
        return
    namespace, name = body.get("namespace", "default"), body.get("name")
    if isinstance(namespace, str) and isinstance(name, str) and _pick(name) % 4:
        exp_id = f"{namespace}.{name}"
        if re.fullmatch(ID_PATTERN, exp_id) and len(exp_id) <= 253:
            case.path_parameters["id"] = exp_id


def _pick(text: str) -> int:
    return sum(map(ord, text))  # stable across runs, unlike hash()


def aim(case) -> None:
    """Point some generated requests at things that exist, so valid requests get past
    "not found" into the engine: completions for a training experiment, status and
    checkpoint of one. Only valid values are swapped for other valid values."""
    method, body = case.method.upper(), case.body
    if method == "PUT":
        tame(body)
        match_id(case)
    elif method == "POST" and case.path in OPENAI_POSTS and isinstance(body, dict):
        model = body.get("model")
        if isinstance(model, str) and 1 <= len(model) <= 253 and _pick(model) % 3:
            body["model"] = BACKGROUND[_pick(model) % 3 - 1]
    elif method in ("GET", "POST") and "{id}" in case.path:
        exp_id = (case.path_parameters or {}).get("id")
        if isinstance(exp_id, str) and re.fullmatch(ID_PATTERN, exp_id) and _pick(exp_id) % 2:
            case.path_parameters["id"] = BACKGROUND[0]


@pytest.mark.parametrize("label", _operations())
def test_fuzz_operation(label: str, fuzz_server: EngineServer, api_schema) -> None:
    operations = {}
    for result in api_schema.get_all_operations():
        op = result.ok()  # an invalid schema raises here
        operations[op.label] = op
    op = operations[label]
    strategy = op.as_strategy(GenerationMode.POSITIVE) | op.as_strategy(GenerationMode.NEGATIVE)

    @given(case=strategy)
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case) -> None:
        aim(case)
        response = case.call_and_validate(
            base_url=fuzz_server.url,
            headers=fuzz_server.headers,
            timeout=120,
            checks=CHECKS,
        )
        SEEN[(label, response.status_code)] += 1
        # Free the one spare slot again, so later examples reach the engine's own checks.
        with fuzz_server.client() as api:
            for s in api.get("/v1/experiments").json()["experiments"]:
                if s["id"] not in BACKGROUND:
                    assert api.delete(f"/v1/experiments/{s['id']}").status_code in (200, 404)

    run()
    if label == "PUT /v1/experiments/{id}":
        _put_a_valid_experiment(op, fuzz_server)


def _put_a_valid_experiment(op: Any, fuzz_server: EngineServer) -> None:
    """One known-valid PUT through the same checks: which generated bodies survive the
    engine's own checks (limits, trust, ids) depends on what hypothesis draws, so the
    201 answer's schema is checked here whatever it drew."""
    exp_id = "default.fuzz-valid"
    case = op.schema.make_case(
        operation=op,
        path_parameters={"id": exp_id},
        body=put_body(exp_id, small_spec()),
        media_type="application/json",
    )
    response = case.call_and_validate(
        base_url=fuzz_server.url, headers=fuzz_server.headers, timeout=120, checks=CHECKS
    )
    SEEN[("PUT /v1/experiments/{id}", response.status_code)] += 1
    with fuzz_server.client() as api:
        assert api.delete(f"/v1/experiments/{exp_id}").status_code == 200


def test_server_survived_and_kept_training(fuzz_server: EngineServer) -> None:
    assert fuzz_server.proc is not None and fuzz_server.proc.poll() is None
    assert httpx.get(f"{fuzz_server.url}/healthz").status_code == 200
    assert httpx.get(f"{fuzz_server.url}/readyz").status_code == 200
    with fuzz_server.client() as api:
        before = {e: _step(api, e) for e in BACKGROUND}
        wait_until(lambda: all(_step(api, e) >= before[e] + 2 for e in BACKGROUND), timeout=60)
        for e in BACKGROUND:
            s = api.get(f"/v1/experiments/{e}").json()
            assert s["phase"] == "Running" and s["error"] is None, s
    assert "unhandled error" not in fuzz_server.log_text()
    print("fuzz responses:", dict(sorted(SEEN.items())))
    if len({label for label, _ in SEEN}) == len(_operations()):  # the whole module ran
        for label, status in [
            ("PUT /v1/experiments/{id}", 201),
            ("PUT /v1/experiments/{id}", 422),
            ("POST /v1/completions", 200),
            ("POST /v1/completions", 400),  # OpenAI's status for a bad request
            ("GET /v1/experiments/{id}", 200),
            ("POST /v1/experiments/{id}/checkpoint", 200),
        ]:
            assert SEEN[(label, status)] > 0, (label, status)
        assert not any(status >= 500 for _, status in SEEN)
