"""`bash bench/gpu.sh --dry-run`: the GPU check's own code on the CPU at a tiny size.

Checks the plumbing a GPU slot would otherwise spend itself on: both strategies train
every tenant's rows with checkpointing, the planner runs for the same workload and its
FLOP floor matches the bench's own for the same tokens, and the result JSON has its
documented shape. Speed is not asserted (a CPU proves nothing about a GPU's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu-dry-run") / "gpu-dry-run.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", "bench/gpu.sh", "--dry-run", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_cell_ran_both_arms_on_the_same_tokens(result: dict) -> None:
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


def test_one_at_a_time_is_n_times_the_single_adapter_step(result: dict) -> None:
    single = result["cells"][0]["arms"]["fused"]["step_s"]
    for cell in result["cells"]:
        derived = cell["arms"]["one_at_a_time"]
        assert derived["derived"] and derived["step_s"] == pytest.approx(cell["n"] * single)
        assert cell["ratios"]["timesliced_over_fused"] > 0


def test_planner_ran_the_same_workload(result: dict) -> None:
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


def test_the_grouped_lora_arm_ran_both_paths(result: dict) -> None:
    """bmm vs the grouped algorithm (its reference loop on the CPU) on each workload, with
    torch's FLOP counter agreeing with ``delta_flops`` on what each path multiplied."""
    arm = result["grouped_lora"]
    assert set(arm) == {"mixed ranks", "uneven groups", "uniform"}, arm.get("error")
    for name, got in arm.items():
        assert got["paths"] == {"bmm": "bmm", "grouped": "reference"}
        counted = {k: v["forward"] for k, v in got["counted_flops"].items()}
        assert counted == got["formula_forward_flops"], name
        assert got["wall_s"]["bmm"] > 0 and got["wall_s"]["grouped"] > 0
    assert arm["mixed ranks"]["bmm_over_grouped_flops"] > 1.5
    assert arm["uniform"]["bmm_over_grouped_flops"] == 1.0
