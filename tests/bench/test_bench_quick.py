"""`make bench-quick` at CI size: the harness runs all four arms end to end (the
pipelined one on the torch rollout: its stages in turn) and writes results.json in the
documented shape with equal token counts across arms (not speed)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARMS = {"sequential_cold", "hot_timesliced", "hot_fused", "pipelined"}
RUN_KEYS = {
    "arm": str,
    "n": int,
    "steps": int,
    "repeat": int,
    "makespan_s": float,
    "mean_completion_s": float,
    "model_load_s": float,
    "phase_s": dict,
    "rollout_tokens": int,
    "train_tokens": int,
    "final_reward_mean": float,
    "peak_rss_bytes": int,
    "max_staleness": int,
    "loadavg_1m_start": float,
}
RATIO_KEYS = {
    "n",
    "steps",
    "fused_vs_sequential",
    "fused_vs_sequential_excl_load",
    "fused_vs_timesliced",
    "fused_vs_timesliced_excl_load",
    "pipelined_vs_fused",
    "pipelined_vs_fused_excl_load",
    "pipelined_vs_fused_excl_load_per_repeat",
    "train_phase_fused_vs_timesliced",
}
PARITY_KEYS = {
    ("sequential_cold", "hot_fused"): {
        "n",
        "steps",
        "experiment",
        "arms",
        "sequential_last_k_mean",
        "fused_last_k_mean",
        "within_2se",
    },
    ("hot_fused", "pipelined"): {
        "n",
        "steps",
        "experiment",
        "arms",
        "hot_fused_last_k_mean",
        "pipelined_last_k_mean",
        "within_2se",
    },
}


@pytest.fixture(scope="module")
def results(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`make bench-quick` itself, with the grid cut to CI size (N=1,2, 2 steps, 1 repeat)."""
    out = tmp_path_factory.mktemp("bench-quick")
    quick_args = [
        "--preset=tiny",
        f"--model-dir={tiny_model_dir}",
        "--ns=1,2",
        "--steps=2",
        "--repeats=1",
        "--warmup=0",
        "--group=2",
        "--prompts=2",
        "--max-new-tokens=4",
        "--arms=sequential_cold,hot_timesliced,hot_fused,pipelined",
    ]
    cmd = [
        "make",
        "--no-print-directory",
        "bench-quick",
        f"PY={sys.executable}",
        f"BENCH_QUICK_ARGS={' '.join(quick_args)}",
        f"BENCH_QUICK_OUT={out}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "throughput.png").stat().st_size > 0
    assert (out / "rewards.png").stat().st_size > 0
    return json.loads((out / "results.json").read_text())


def test_results_have_the_documented_shape(results: dict) -> None:
    assert set(results) == {"config", "runs", "ratios", "reward_parity"}
    assert {(r["arm"], r["n"]) for r in results["runs"]} == {(a, n) for a in ARMS for n in (1, 2)}
    for run in results["runs"]:
        for key, kind in RUN_KEYS.items():
            assert isinstance(run[key], kind), (key, run[key])
        assert set(run["phase_s"]) == {"rollout", "reward", "train", "sync"}
        assert run["makespan_s"] > run["model_load_s"] > 0
        assert 0 < run["mean_completion_s"] <= run["makespan_s"] + 1e-6
        assert run["peak_rss_bytes"] > 0 and math.isfinite(run["final_reward_mean"])
    assert [(r["n"], r["steps"]) for r in results["ratios"]] == [(1, 2), (2, 2)]
    for ratio in results["ratios"]:
        assert set(ratio) == RATIO_KEYS
        per_repeat = ratio["pipelined_vs_fused_excl_load_per_repeat"]
        assert len(per_repeat) == 1 and per_repeat[0] > 0  # one repeat
        assert all(v > 0 for v in ratio.values() if isinstance(v, float))
    # one row per pair of arms, experiment and cell: 2 x (1 + 2 experiments)
    assert len(results["reward_parity"]) == 6
    for row in results["reward_parity"]:
        assert set(row) == PARITY_KEYS[tuple(row["arms"])] and isinstance(row["within_2se"], bool)
    # on-policy: every pipelined step sampled the weights of the step before
    assert all(r["max_staleness"] == 0 for r in results["runs"])


def test_token_counts_are_equal_across_arms(results: dict) -> None:
    for n in (1, 2):
        runs = [r for r in results["runs"] if r["n"] == n]
        assert len({r["rollout_tokens"] for r in runs}) == 1, runs
        assert len({r["train_tokens"] for r in runs}) == 1, runs
        # fixed generation length: every rollout generated exactly maxNewTokens
        assert runs[0]["rollout_tokens"] == n * 2 * (2 * 2) * 4
