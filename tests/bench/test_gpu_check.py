"""bench/gpu_check.py's time budget: arms and cells past it are skipped and recorded, an
arm past its share is killed with everything it started, and the run ends within it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
import gpu_check  # noqa: E402
from gpu_common import parse_memory_used, run_in_group  # noqa: E402


def test_an_arm_past_its_share_is_killed_with_its_children(tmp_path: Path) -> None:
    """A process that starts two children and hangs: None (ran past) within the timeout,
    and none of the three is left, the one in a session of its own included."""
    pids = tmp_path / "pids"
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    script = (  # one child in its group, one in a session of its own (as `run` is)
        "import os, subprocess, sys, time;"
        f"a = subprocess.Popen({sleeper!r});"
        f"b = subprocess.Popen({sleeper!r}, start_new_session=True);"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{a.pid}} {{b.pid}}');"
        "time.sleep(600)"
    )
    polls = []
    started = time.monotonic()
    # 8 s: time for the child to start its own child first, on a loaded 2-core box
    cmd = [sys.executable, "-c", script]
    code = run_in_group(cmd, 8.0, every_s=0.5, on_wait=lambda: polls.append(1))
    took = time.monotonic() - started
    assert code is None and 8.0 <= took < 20, took
    assert polls, "on_wait never ran while the process ran"
    pid_list = [int(p) for p in pids.read_text().split()]
    assert len(pid_list) == 3
    for pid in pid_list:
        assert not running(pid), pid


def running(pid: int, within_s: float = 5.0) -> bool:
    """Still running ``within_s`` after the kill (SIGKILL lands asynchronously)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            alive = False
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def test_an_arm_that_ends_gives_its_exit_code() -> None:
    assert run_in_group([sys.executable, "-c", "raise SystemExit(3)"], 60) == 3


def test_shares_split_what_is_left_by_weight() -> None:
    scale, vllm, dp = gpu_check.ARMS
    left = 570.0
    first = gpu_check.shares(left, [scale, vllm, dp])
    assert first == pytest.approx((left - gpu_check.RESERVE_S) * scale.weight)
    # an arm skipped up front leaves its weight to the others
    assert gpu_check.shares(left, [scale, vllm]) > first
    assert gpu_check.shares(left, [dp]) == pytest.approx(left - gpu_check.RESERVE_S)
    assert gpu_check.shares(5.0, [dp]) == 0.0
    for share in (20.0, 100.0, 300.0):
        assert 0 < share - gpu_check.soft_budget(share) <= max(15.0, 0.2 * share)


def test_nvidia_smi_memory_is_read_per_gpu() -> None:
    assert parse_memory_used("0, 1024\n1, 3\nbad line\n") == {0: 1 << 30, 1: 3 << 20}
    assert parse_memory_used("") == {}


def test_a_budget_too_short_skips_and_records_instead_of_running(tmp_path: Path) -> None:
    """40 s for the vLLM and dp arms: vLLM's share (under the 30 s it needs) skips it,
    dp runs with too little to start a run, so each of its runs is recorded as skipped;
    the JSON says all of it and the whole call ends within the 40 s."""
    out = tmp_path / "gpu.json"
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'trainer-image'}:{os.environ.get('PYTHONPATH', '')}",
    }
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry-run", "--budget-s", "40",
         "--arms", "vllm,dp", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert took < 40 + 5, took  # the interpreter's start and exit aside
    assert set(result["arms"]) == {"vllm", "dp"}
    skipped = {s["arm"]: s["why"] for s in result["skipped"]}
    assert skipped.keys() == {"vllm"} and (
        "time budget" in skipped["vllm"] or "no vLLM" in skipped["vllm"]
    )
    dp = result["arms"]["dp"]
    assert dp["exit_code"] == 0 and dp["cells"] == []
    assert [s["cell"] for s in dp["skipped"]] == [
        "world_size_1",
        "world_size_2",
        "world_size_2_sharded",
    ]
    assert all("time budget" in s["why"] or "--shard-base" in s["why"] for s in dp["skipped"])


def test_a_cell_that_fails_is_recorded_and_the_arm_goes_on(tmp_path: Path) -> None:
    """The vLLM arm's cell with an option the engine refuses on the CPU (sleep mode):
    the cell carries the engine's one-line error and its state; nothing raises."""
    import argparse

    import gpu_vllm
    from gpu_common import DRY_RUN_WORKLOAD, FAMILY_MODEL_DIRS, Budget

    args = argparse.Namespace(dry_run=True, out=tmp_path / "vllm.json")
    result: dict = {"cells": []}
    cell = gpu_vllm.run_placement(
        "cpu-sleeping", {"sleep_mode": True}, FAMILY_MODEL_DIRS[True], DRY_RUN_WORKLOAD,
        args, Budget.of(60), result,
    )  # fmt: skip
    assert cell["cell"] == "cpu-sleeping" and cell["state"] == "failed"
    assert "sleep_mode needs CUDA" in cell["error"]
    assert json.loads(args.out.read_text())["cells"][0]["state"] == "starting"


# ---- the GPU-only branches, as pure logic (no GPU here) -------------------------------


def test_vllm_placements_on_one_and_two_gpus() -> None:
    import gpu_vllm

    one = gpu_vllm.placements(False, 1)
    assert [(c, o) for c, o, _ in one] == [
        ("colocated", {"sleep_mode": True}),
        ("separate", {"device": "cuda:1"}),
    ]
    assert one[0][2] is None and "second GPU" in one[1][2]
    assert all(why is None for _, _, why in gpu_vllm.placements(False, 2))


def test_a_failed_sleeping_cell_is_tried_once_more_awake() -> None:
    import gpu_vllm

    failed = {"cell": "colocated", "options": {"sleep_mode": True}, "state": "failed"}
    (again,) = gpu_vllm.fallback(failed)
    assert again == ("colocated_awake", {"sleep_mode": False}, None)
    assert gpu_vllm.fallback({"cell": again[0], "options": again[1], "state": "failed"}) == []
    assert gpu_vllm.fallback(failed | {"state": "done"}) == []


def test_vllm_summary_takes_medians_after_the_warm_up_tick() -> None:
    import gpu_vllm

    def tick(rate: float, sleep: list[float], gap: float) -> dict:
        wake = [s / 2 for s in sleep]
        return {"rollout_tokens_per_s": rate, "phase_s": {"train": 2.0}, "sync_s": 0.1,
                "sleep_s": sleep, "wake_s": wake, "logprob_gap": {"a": gap}}  # fmt: skip

    cell = {"ticks": [tick(1.0, [9.0], 0.9), tick(100.0, [1.0], 0.01), tick(300.0, [3.0], 0.03)]}
    got = gpu_vllm.summarize(cell)
    assert got["rollout_tokens_per_s"] == 200.0 and got["ticks_summarized"] == 2
    assert got["sleep_s"] == 2.0 and got["wake_s"] == 1.0
    assert got["logprob_gap_mean"] == pytest.approx(0.02)


def test_dp_cells_follow_the_flags_run_has() -> None:
    import gpu_dp
    from gpu_common import has_flag

    plain = "options:\n  --world-size WORLD_SIZE\n  --device-memory BYTES  the --device flag\n"
    assert not has_flag(plain, "--device") and has_flag(plain, "--world-size")
    assert gpu_dp.why_skip(False, plain) is not None  # no GPUs here, or no --device
    cells = {name: (flags, why) for name, flags, why in gpu_dp.cells(plain)}
    assert "--shard-base" in cells["world_size_2_sharded"][1]
    sharded = plain + "  --shard-base           shard the base over the ranks\n"
    cells = {name: (flags, why) for name, flags, why in gpu_dp.cells(sharded)}
    assert cells["world_size_2_sharded"] == (["--world-size", "2", "--shard-base"], None)
