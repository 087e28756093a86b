"""The GSM8K workload on a real ``loraplex-engine serve`` with the tiny model: the gsm8k
task scored by the math-verify reward plug-in, and the calculator-tool environment,
each trained to completion (a few steps) with a reward recorded every step, through the
engine's own entry points as this tree declares them (``engine_site``). What is checked
is that the workload runs end to end, not that a random tiny model learns arithmetic
(its rewards are 0)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.plugin_install import with_path
from tests.support.plugin_workers import workers
from tests.support.server_process import EngineServer, wait_until
from tests.support.tenant_api import put, spec, status

pytestmark = pytest.mark.slow

STEPS = 3
ARGS = ["--max-prompt-tokens", "512", "--max-step-tokens", "20000", "--plugin-timeout", "60"]


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, engine_site: Path
) -> Iterator[EngineServer]:
    work = tmp_path_factory.mktemp("gsm8k")
    srv = EngineServer(
        tiny_model_dir,
        work / "ckpt",
        max_adapters=4,
        workdir=work,
        extra_args=ARGS,
        env=with_path(engine_site),
    )
    with srv:
        yield srv


def _finished(server: EngineServer, exp: str, body: dict[str, Any]) -> dict[str, Any]:
    body["algorithm"]["maxSteps"] = STEPS
    with server.client() as api:
        r = put(api, exp, body)
        assert r.status_code == 201, r.text
        s = wait_until(
            lambda: (s := status(api, exp))["phase"] in ("Succeeded", "Failed") and s,
            timeout=300,
        )
    assert s["phase"] == "Succeeded", s
    assert s["step"] == STEPS and s["reward"] is not None and 0.0 <= s["reward"] <= 1.0, s
    return s


def test_gsm8k_trains_with_the_math_verify_reward(server: EngineServer) -> None:
    task = {"name": "gsm8k", "params": {"maxSteps": "2"}, "reward": "math-verify"}
    with server.client() as api:
        plugins = api.get("/v1/capacity").json()["plugins"]
    assert "math-verify" in plugins["rewards"] and "gsm8k-calculator" in plugins["environments"]
    s = _finished(server, "team-a.gsm8k", spec(task, new_tokens=8))
    assert s["rolloutTokens"] > 0, s
    scorer = [" ".join(w.cmdline()) for w in workers(server)]
    assert any("reward:math-verify" in c for c in scorer), scorer  # scored by the plug-in
    with server.client() as api:
        assert api.delete("/v1/experiments/team-a.gsm8k").status_code == 200
    wait_until(lambda: not workers(server), timeout=30)  # removed: its reward worker ends


def test_gsm8k_trains_with_the_calculator_environment(server: EngineServer) -> None:
    env = {"name": "gsm8k-calculator", "maxTurns": 3, "maxEpisodeTokens": 128}
    task = {"name": "gsm8k", "params": {"maxSteps": "2", "hint": "false"}, "environment": env}
    s = _finished(server, "team-a.gsm8k-calc", spec(task, new_tokens=8))
    assert s["rolloutTokens"] > 0, s
    episodes = [" ".join(w.cmdline()) for w in workers(server)]
    assert any("environment:gsm8k-calculator" in c for c in episodes), episodes  # its worker
    with server.client() as api:
        assert api.delete("/v1/experiments/team-a.gsm8k-calc").status_code == 200
    wait_until(lambda: not workers(server), timeout=30)  # removed: its worker ends


def test_a_bad_environment_param_is_refused_at_put(server: EngineServer) -> None:
    """The calculator checks its params when asked at PUT (check_params): an unknown one is
    the PUT's 422 naming it, nothing admitted, its worker stopped."""
    env = {"name": "gsm8k-calculator", "maxTurns": 2, "params": {"tools": "all"}}
    body = spec({"name": "gsm8k", "environment": env}, new_tokens=4)
    with server.client() as api:
        r = put(api, "team-a.bad-env", body)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["field"] == "spec.task.environment.params.tools", error
        assert "unknown param; known: instructions" in error["message"], error
        assert api.get("/v1/experiments/team-a.bad-env").status_code == 404
    wait_until(lambda: not workers(server), timeout=30)
