"""Crash safety over HTTP: `kill -9` a real engine server mid-training, start a new one on
the same checkpoint storage, PUT each experiment with `resumeFrom` its newest
checkpoint (or only its `runId`, as the operator does when it never saw a checkpoint),
and check it continues from exactly there. Then SIGTERM: the server drains,
checkpoints what is running and exits 0. No fakes: `loraplex-engine serve`, tiny model.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from tests.support.server_process import EngineServer, record_measurement, wait_until
from tests.support.server_specs import put_body, small_spec

pytestmark = pytest.mark.slow

EXPS = {"default.crash-a": 0, "default.crash-b": 1, "team-c.crash-c": 2}
RUN_ONLY = "team-c.crash-c"  # resumed by runId alone, no resumeFrom
CKPT_FILES = (
    "adapter_config.json",
    "adapter_model.safetensors",
    "trainer_state.json",
    "optimizer.safetensors",
)


def spec_for(exp_id: str, **kw) -> dict:
    return small_spec("yes", seed=EXPS.get(exp_id, 7), **kw)


def run_id(exp_id: str) -> str:
    return f"uid-{exp_id}"


def newest_checkpoint(root: Path, exp_id: str) -> Path:
    """The newest complete `step-NNNNNNNN` directory of the experiment's run; temp dirs
    never match the name."""
    namespace, name = exp_id.split(".", 1)
    run_dir = root / namespace / name / run_id(exp_id)
    dirs = sorted(p for p in run_dir.iterdir() if re.fullmatch(r"step-\d{8}", p.name))
    assert dirs, f"no checkpoint for {exp_id}"
    return dirs[-1]


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a)), load_file(str(b))
    assert ta.keys() == tb.keys(), (a, b)
    assert ta, a
    for key in ta:
        assert ta[key].equal(tb[key]), f"{key} differs between {a} and {b}"


def test_kill_9_restart_and_resume_from_the_last_checkpoint(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    srv = EngineServer(
        tiny_model_dir, tmp_path / "ckpt", max_adapters=4, max_rank=16, workdir=tmp_path
    )
    root = srv.checkpoint_root
    try:
        srv.start()
        with srv.client() as api:
            for exp_id in EXPS:
                body = put_body(exp_id, spec_for(exp_id), run_id=run_id(exp_id))
                r = api.put(f"/v1/experiments/{exp_id}", json=body)
                assert r.status_code == 201, r.text
                assert r.json()["runId"] == run_id(exp_id) and r.json()["step"] == 0

            def checkpointed_twice() -> bool:
                listed = api.get("/v1/experiments").json()["experiments"]
                return len(listed) == 3 and all(
                    s["checkpoint"] and s["checkpoint"]["step"] >= 4 for s in listed
                )

            # Ticks run back to back, so the kill lands mid-tick or mid-checkpoint-write.
            wait_until(checkpointed_twice, timeout=120)
            srv.kill()  # SIGKILL: no shutdown checkpoint, no cleanup
            assert srv.proc is not None and srv.proc.returncode == -9

        newest = {e: newest_checkpoint(root, e) for e in EXPS}
        for path in newest.values():
            for f in CKPT_FILES:
                assert (path / f).is_file(), path / f
            assert json.loads((path / "trainer_state.json").read_text())  # complete, parses
        # The resumed runs will prune old checkpoints (keep: 2); keep one aside to compare,
        # in the directory of the experiment that loads it below (a resumeFrom must lie in
        # the experiment's own directory).
        source = root / "default" / "crash-a-copy" / "kept" / newest["default.crash-a"].name
        shutil.copytree(newest["default.crash-a"], source)

        srv.start()
        record_measurement(
            "startup_s_restart", srv.startup_s, "process start -> /readyz 200 after kill -9"
        )
        with srv.client() as api:
            assert (
                api.get("/v1/experiments").json()["experiments"] == []
            )  # nothing survives in memory
            for exp_id, path in newest.items():
                resume = None if exp_id == RUN_ONLY else str(path)
                body = put_body(exp_id, spec_for(exp_id), resume, run_id(exp_id))
                r = api.put(f"/v1/experiments/{exp_id}", json=body)
                assert r.status_code == 201, r.text
                resumed = r.json()
                assert resumed["step"] == step_of(path), (exp_id, resumed)
                assert resumed["checkpoint"] == {"path": str(path), "step": step_of(path)}
                assert resumed["phase"] == "Running"

            # The resumed adapter holds exactly the checkpoint's weights and moments. To look
            # at them before a tick moves them on, load the same checkpoint once more as a
            # copy whose maxSteps is the checkpoint's step: it is done on arrival, never
            # trains, and its checkpoint is written from the loaded tensors.
            k = step_of(source)
            copy_id = "default.crash-a-copy"
            r = api.put(
                f"/v1/experiments/{copy_id}",
                json=put_body(copy_id, spec_for("default.crash-a", max_steps=k), str(source)),
            )
            assert r.status_code == 201, r.text
            assert r.json()["step"] == k and r.json()["phase"] == "Succeeded"
            r = api.post(f"/v1/experiments/{copy_id}/checkpoint")
            assert r.status_code == 200, r.text
            written = Path(r.json()["path"])
            # A copy of another run's checkpoint goes on under that run's id, in its own
            # experiment's directory.
            assert r.json()["step"] == k and written.parent.parent.name == "crash-a-copy"
            assert written.parent.name == run_id("default.crash-a")
            assert_same_tensors(
                source / "adapter_model.safetensors", written / "adapter_model.safetensors"
            )
            assert_same_tensors(source / "optimizer.safetensors", written / "optimizer.safetensors")

            # Training continues from the checkpointed step, and checkpoints go on.
            wait_until(
                lambda: all(
                    api.get(f"/v1/experiments/{e}").json()["step"] >= step_of(newest[e]) + 3
                    for e in EXPS
                ),
                timeout=120,
            )
            for e in EXPS:
                s = api.get(f"/v1/experiments/{e}").json()
                assert s["checkpoint"]["step"] > step_of(newest[e]), s
                assert s["phase"] == "Running" and s["error"] is None
            last_seen = {e: api.get(f"/v1/experiments/{e}").json()["step"] for e in EXPS}

        # SIGTERM: graceful drain, then a checkpoint of every running experiment.
        t = time.monotonic()
        assert srv.stop(timeout=60) == 0, srv.log_tail()
        record_measurement(
            "shutdown_s_sigterm", time.monotonic() - t, "SIGTERM -> exit, 3 checkpoints"
        )
        for e in EXPS:
            assert step_of(newest_checkpoint(root, e)) >= last_seen[e], e
        assert "shutdown checkpoint" in srv.log_text()
    finally:
        srv.kill()


def test_refuses_to_start_without_a_token(tiny_model_dir: Path, tmp_path: Path) -> None:
    import subprocess

    from tests.support.server_process import engine_command

    cmd = [*engine_command(), "serve", "--model", str(tiny_model_dir), "--port", "0"]
    env = {k: v for k, v in __import__("os").environ.items() if k != "LORAPLEX_TOKEN"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert r.returncode != 0
    assert "no token" in r.stderr and "--insecure-no-auth" in r.stderr


def test_insecure_mode_and_flags_from_env(tiny_model_dir: Path, tmp_path: Path) -> None:
    """--insecure-no-auth serves /v1 without a token; LORAPLEX_<FLAG> sets a flag."""
    srv = EngineServer(
        tiny_model_dir,
        tmp_path / "ckpt",
        workdir=tmp_path,
        auth=False,
        max_adapters=None,
        env={"LORAPLEX_MAX_ADAPTERS": "3", "LORAPLEX_TOKEN": ""},
    )
    try:
        srv.start()
        r = httpx.get(f"{srv.url}/v1/capacity")
        assert r.status_code == 200 and r.json()["maxAdapters"] == 3
        assert "WITHOUT authentication" in srv.log_text()
    finally:
        srv.kill()
