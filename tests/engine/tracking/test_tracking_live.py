"""Experiment tracking end to end: a real `loraplex-engine serve` process (the tiny model
on CPU) records two tenants' experiments to a real MLflow tracking server (`mlflow
server`, SQLite, on 127.0.0.1) and to TensorBoard event files; read back with MLflow's own
client and TensorBoard's own reader, the runs hold exactly the engine's numbers (its
status: last reward, step count, token totals). Then the same with the MLflow URI on a
port where nothing listens: training reaches the same step counts, the other tracker
records every step, and the failure is in the log and the tracking series.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mlflow.tracking import MlflowClient
from prometheus_client.parser import text_string_to_metric_families

from tests.support import child_processes
from tests.support.event_reader import scalars
from tests.support.server_process import EngineServer, wait_until
from tests.support.server_specs import put_body, small_spec

pytestmark = pytest.mark.slow

STEPS = 4
# Bounds on waiting for processes on a shared 2-core machine, not speed expectations.
MLFLOW_START_S = 300.0
TRAIN_S = 240.0
EXPECTED = {
    "reward_mean", "reward_std", "kl", "entropy", "clip_fraction", "response_length",
    "step_seconds", "rollout_tokens", "train_tokens",
}  # fmt: skip
TWO = {
    "team-a.say-yes": {"runName": "lr-0.05", "tags": [{"name": "sweep", "value": "lr"}]},
    "team-b.say-no": None,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    mlflow = Path(sys.executable).with_name("mlflow")
    cmd = [
        str(mlflow), "server",
        "--backend-store-uri", f"sqlite:///{work / 'mlflow.db'}",
        "--default-artifact-root", str(work / "artifacts"),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    # litellm (installed beside mlflow here) would try to fetch a price list at import.
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    log = (work / "server.log").open("wb")
    out = {"stdout": log, "stderr": subprocess.STDOUT, "stdin": subprocess.DEVNULL}
    proc = child_processes.spawn(cmd, "mlflow server", env=env, **out)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, (work / "server.log").read_text()[-3000:]
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, timeout=MLFLOW_START_S, interval=0.5)
        yield url
    finally:
        child_processes.kill_group(proc)
        log.close()


def spec_of(exp_id: str, seed: int) -> dict[str, Any]:
    spec = small_spec("yes" if "yes" in exp_id else "no", seed=seed, max_steps=STEPS)
    tracking = TWO[exp_id]
    return spec | ({"tracking": tracking} if tracking else {})


def train_two(srv: EngineServer) -> dict[str, dict[str, Any]]:
    """Both experiments to maxSteps; their final statuses."""
    with srv.client() as api:
        for seed, exp_id in enumerate(TWO):
            r = api.put(f"/v1/experiments/{exp_id}", json=put_body(exp_id, spec_of(exp_id, seed)))
            assert r.status_code == 201, r.text

        def done() -> dict[str, dict[str, Any]] | None:
            out = {e: api.get(f"/v1/experiments/{e}").json() for e in TWO}
            return out if all(s["phase"] != "Running" for s in out.values()) else None

        return wait_until(done, timeout=TRAIN_S, interval=0.2)


def tracking_series(srv: EngineServer) -> dict[tuple[str, str], float]:
    """(series name, tracker) -> value, from the engine's /metrics."""
    out = {}
    scrape = httpx.get(f"{srv.url}/metrics", headers=srv.headers).text
    for family in text_string_to_metric_families(scrape):
        for s in family.samples:
            if s.name.startswith("loraplex_engine_tracking_"):
                out[(s.name, s.labels["tracker"])] = s.value
    return out


def engine(tiny_model_dir: Path, work: Path, tracking_args: list[str]) -> EngineServer:
    return EngineServer(
        tiny_model_dir,
        work / "ckpt",
        workdir=work,
        extra_args=tracking_args,
        env={"LORAPLEX_POOL": "pool-t"},
    )


def test_two_experiments_runs_hold_the_engines_own_numbers(
    mlflow_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    tb = tmp_path / "tb"
    args = ["--tracking-mlflow-uri", mlflow_url, "--tracking-tensorboard-dir", str(tb)]
    with engine(tiny_model_dir, tmp_path, args) as srv:
        statuses = train_two(srv)
        assert {e: s["phase"] for e, s in statuses.items()} == dict.fromkeys(TWO, "Succeeded")
        client = MlflowClient(tracking_uri=mlflow_url)

        def runs() -> dict[str, Any] | None:
            found = {}
            for exp_id in TWO:
                namespace = exp_id.split(".")[0]
                experiment = client.get_experiment_by_name(f"loraplex/{namespace}")
                if experiment is None:
                    return None
                listed = client.search_runs([experiment.experiment_id])
                assert len(listed) <= 1, listed  # one run per experiment run
                if not listed or listed[0].info.status != "FINISHED":
                    return None
                found[exp_id] = listed[0]
            return found

        try:
            recorded = wait_until(runs, timeout=60, interval=0.5)
        except TimeoutError:
            raise AssertionError(srv.log_tail(80)) from None
        series = tracking_series(srv)
    assert series[("loraplex_engine_tracking_records_total", "mlflow")] == 2 * STEPS
    assert series[("loraplex_engine_tracking_errors_total", "mlflow")] == 0
    assert series[("loraplex_engine_tracking_up", "mlflow")] == 1

    for exp_id, run in recorded.items():
        status, (namespace, name) = statuses[exp_id], exp_id.split(".")
        tags = run.data.tags
        assert tags["loraplex.namespace"] == namespace and tags["loraplex.experiment"] == name
        assert tags["loraplex.runId"] == status["runId"] and tags["loraplex.pool"] == "pool-t"
        if TWO[exp_id]:
            assert run.info.run_name == "lr-0.05" and tags["sweep"] == "lr"
        else:
            assert run.info.run_name == name and "sweep" not in tags
        assert set(run.data.metrics) >= EXPECTED

        def history(key: str, run_id: str = run.info.run_id) -> list[tuple[int, float]]:
            return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))

        rewards = history("reward_mean")
        assert [s for s, _ in rewards] == list(range(1, STEPS + 1)) == [s for s, _ in history("kl")]
        assert status["step"] == STEPS
        # the same float64 the status carries: no tolerance needed
        assert rewards[-1][1] == status["reward"]
        assert sum(v for _, v in history("rollout_tokens")) == status["rolloutTokens"]
        assert sum(v for _, v in history("train_tokens")) == status["trainTokens"]
        assert all(0.0 <= v <= 1.0 for _, v in history("clip_fraction"))
        assert all(v >= 0.0 for _, v in history("entropy") + history("reward_std"))
        # TensorBoard got the very same records
        event_files = scalars(tb / namespace / name / status["runId"])
        assert event_files["reward_mean"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in rewards]


def test_a_tracker_that_is_down_costs_training_nothing(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tb = tmp_path / "tb"
    args = ["--tracking-mlflow-uri", dead, "--tracking-tensorboard-dir", str(tb)]
    with engine(tiny_model_dir, tmp_path, args) as srv:
        statuses = train_two(srv)
        series = tracking_series(srv)
        assert srv.stop() == 0  # shutdown is not held up by it either
        log = srv.log_text()
    assert {e: (s["phase"], s["step"]) for e, s in statuses.items()} == dict.fromkeys(
        TWO, ("Succeeded", STEPS)
    )
    assert series[("loraplex_engine_tracking_errors_total", "mlflow")] >= 1
    assert series[("loraplex_engine_tracking_up", "mlflow")] == 0
    assert series[("loraplex_engine_tracking_records_total", "mlflow")] == 0
    assert series[("loraplex_engine_tracking_records_total", "tensorboard")] == 2 * STEPS
    assert "tracking: mlflow failed" in log and "training goes on" in log
    for exp_id, status in statuses.items():
        namespace, name = exp_id.split(".")
        steps = [s for s, _ in scalars(tb / namespace / name / status["runId"])["reward_mean"]]
        assert steps == list(range(1, STEPS + 1))
