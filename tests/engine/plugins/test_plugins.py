"""Issue 30 item 1 on a real ``loraplex-engine serve``: reward functions and environments
installed as a package through entry points (tests/plugins/loraplex_test_plugins,
installed for real: plugin_install.py) are listed by /v1/capacity, usable by name, and an
unknown name is refused at PUT listing them, and so are an environment's bad params
(the first-party calculator's too) and params past their bounds (a name of megabytes:
the answer echoes a prefix of it at most); a TRL-style reward trains; a reward plug-in
that raises, hangs, returns NaN or the wrong count, or fails to import, fails its own
experiment alone (its worker process gone), while a bystander keeps training.

The engine bounds each plug-in call at PLUGIN_TIMEOUT_S (--plugin-timeout) and waits
0.3 s for a tick's rewards (a late one trains in a later tick), as test_reward_bounds.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.plugin_install import with_path
from tests.support.plugin_workers import workers
from tests.support.server_process import EngineServer, wait_until
from tests.support.tenant_api import LIMITS, failed, put, spec, status

pytestmark = pytest.mark.slow

BYSTANDER = "team-b.bystander"
PLUGIN_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    plugins_site: Path,
    engine_site: Path,
) -> Iterator[EngineServer]:
    work = tmp_path_factory.mktemp("plugins")
    args = [*LIMITS, "--plugin-timeout", str(PLUGIN_TIMEOUT_S), "--reward-deadline", "0.3"]
    srv = EngineServer(
        tiny_model_dir,
        work / "ckpt",
        max_adapters=8,
        workdir=work,
        extra_args=args,
        env=with_path(plugins_site, engine_site),  # the engine's own plug-ins as this tree has them
    )
    with srv, srv.client() as api:
        assert put(api, BYSTANDER, spec()).status_code == 201
        wait_until(lambda: status(api, BYSTANDER)["step"] >= 1)
        yield srv


def test_capacity_lists_the_installed_plugins(server: EngineServer) -> None:
    with server.client() as api:
        plugins = api.get("/v1/capacity").json()["plugins"]
    # The test package's and the engine's own (math-verify: docs/workloads.md).
    test_package = ["broken", "hangs", "math-verify", "nan", "raises", "says-target", "too-few"]
    assert plugins["rewards"] == test_package
    # The package's entry points, then skyrl-gym's registered ids (it is installed here).
    names = ["gated", "gsm8k-calculator", "hangs-env", "impersonates", "never-ends"]
    names += ["sleeps", "word-tool"]
    assert plugins["environments"][: len(names)] == names
    assert {"gsm8k", "gsm8k_multi_turn"} <= set(plugins["environments"])


@pytest.mark.parametrize(
    ("task", "field", "listed"),
    [
        ({"name": "target-token", "reward": "nope"}, "spec.task.reward", "says-target"),
        (
            {"name": "target-token", "environment": {"name": "nope"}},
            "spec.task.environment.name",
            "word-tool, aime",
        ),
        (
            {"name": "target-token", "reward": "says-target", "environment": {"name": "gsm8k"}},
            "spec.task.reward",
            "the environment scores",
        ),
    ],
)
def test_an_unknown_plugin_is_refused_at_put_listing_the_installed(
    server: EngineServer, task: dict, field: str, listed: str
) -> None:
    with server.client() as api:
        before = len(workers(server))
        r = put(api, "team-a.unknown", spec(task))
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["field"] == field and listed in error["message"], error
        assert api.get("/v1/experiments/team-a.unknown").status_code == 404
    assert len(workers(server)) == before  # nothing was started for it


@pytest.mark.parametrize(
    ("environment", "field", "message"),
    [
        (  # the environment's own check_params (ParamError): a param it lacks
            {"name": "gated"},
            "spec.task.environment.params",
            "environment gated refused its params: gate: is required",
        ),
        (  # ... and one it refuses, named in the field
            {"name": "gated", "params": {"gate": "relative/file"}},
            "spec.task.environment.params.gate",
            "must be an absolute path, not 'relative/file'",
        ),
        (  # a skyrl-gym environment checks in its constructor: one is built
            {"name": "word-tool", "params": {"word": "4 2"}},
            "spec.task.environment.params",
            "ValueError: env_config word must be letters, not '4 2'",
        ),
        (  # the first-party calculator: an unknown param at PUT, not at its first step
            {"name": "gsm8k-calculator", "params": {"tools": "all"}},
            "spec.task.environment.params.tools",
            "environment gsm8k-calculator refused its params: unknown param; known: instructions",
        ),
        (  # skyrl-gym's text2sql needs omegaconf, which this engine lacks: not the params
            {"name": "text2sql", "params": {"db_id": "x"}},
            "spec.task.environment.name",
            "cannot be loaded here: ModuleNotFoundError: No module named 'omegaconf'",
        ),
    ],
)
def test_bad_environment_params_are_refused_at_put(
    server: EngineServer, environment: dict, field: str, message: str
) -> None:
    """Checked in the experiment's worker at PUT (a 422 naming the param), not when the
    first episode starts; the worker started for the check is stopped."""
    with server.client() as api:
        before = len(workers(server))
        task = {"name": "copy", "environment": environment}
        r = put(api, "team-a.bad-params", spec(task))
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["field"] == field and message in error["message"], error
        assert api.get("/v1/experiments/team-a.bad-params").status_code == 404
        wait_until(lambda: len(workers(server)) == before, timeout=30)


def test_a_trl_style_reward_plugin_trains(server: EngineServer) -> None:
    exp = "team-a.trl"
    task = {"name": "target-token", "params": {"target": "yes"}, "reward": "says-target"}
    with server.client() as api:
        assert put(api, exp, spec(task)).status_code == 201
        s = wait_until(lambda: (s := status(api, exp))["step"] >= 3 and s, timeout=120)
        assert s["phase"] == "Running" and 0.0 <= s["reward"] <= 1.0, s
        assert len(workers(server)) == 1  # its worker, one per experiment with a plug-in
        assert api.delete(f"/v1/experiments/{exp}").status_code == 200
    wait_until(lambda: not workers(server), timeout=30)  # removed: its worker ends


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ("raises", "reward plug-in raises raised RuntimeError: this reward always fails"),
        ("hangs", f"reward plug-in hangs did not answer within {PLUGIN_TIMEOUT_S:g}s"),
        ("nan", "reward plug-in nan: score 0 is not finite"),
        ("too-few", "reward plug-in too-few: 7 scores for 8 completions"),
        ("broken", "reward plug-in broken failed to load: ModuleNotFoundError"),
    ],
)
def test_a_hostile_reward_plugin_fails_only_its_experiment(
    server: EngineServer, reward: str, message: str
) -> None:
    exp = f"team-a.{reward}"
    task = {"name": "target-token", "params": {"target": "yes"}, "reward": reward}
    with server.client() as api:
        step = status(api, BYSTANDER)["step"]
        started = time.monotonic()
        assert put(api, exp, spec(task)).status_code == 201
        s = failed(api, exp, timeout=60)
        assert s["failureReason"] == "reward_error" and message in s["error"], s
        assert time.monotonic() - started < PLUGIN_TIMEOUT_S + 30
        wait_until(lambda: not workers(server), timeout=30)  # killed or stopped
        # The bystander trained on, through the failure and after it.
        wait_until(lambda: status(api, BYSTANDER)["step"] >= step + 3, timeout=60)
        assert status(api, BYSTANDER)["phase"] == "Running"
        assert api.delete(f"/v1/experiments/{exp}").status_code == 200


def _calculator(params: dict[str, str]) -> dict:
    return spec({"name": "gsm8k", "environment": {"name": "gsm8k-calculator", "params": params}})


@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        (  # a 3 MiB name: refused by the names' bound, the name not echoed
            {"x" * (3 << 20): "1"},
            "spec.task.environment.params",
            "task.environment.params names must be 1 to 128 characters",
        ),
        (  # and with a value too long besides: the path shows a prefix of the name
            {"y" * (3 << 20): "v" * 5000},
            "spec.task.environment.params." + "y" * 64 + "...(3145664 more characters)",
            "at most 4096 characters",
        ),
        (  # 17 values at the value limit: 68 KiB as JSON
            {f"k{i}": "v" * 4096 for i in range(17)},
            "spec.task.environment.params",
            "more than the limit of 65536",
        ),
    ],
    ids=["long-name", "long-name-and-value", "too-big"],
)
def test_params_out_of_bounds_are_refused_at_put_echoing_a_prefix(
    server: EngineServer, params: dict[str, str], field: str, message: str
) -> None:
    with server.client() as api:
        r = put(api, "team-a.params", _calculator(params))
        assert r.status_code == 422, r.text[:500]
        assert len(r.content) < 8192, len(r.content)  # no megabyte echoed back
        error = r.json()["error"]
        assert error["field"] == field and message in error["message"], error
        assert api.get("/v1/experiments/team-a.params").status_code == 404
