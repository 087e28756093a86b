"""The Tinker clock stage's own logic, without running it (tests/bench/test_gpu_device.py
runs it): how bench/gpu_tinker.py splits the cores and sums a config up, and how
bench/tinker_clock_report.py judges parity under each dtype's tolerances."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
import gpu_tinker  # noqa: E402
import tinker_clock  # noqa: E402
import tinker_clock_report as report  # noqa: E402


def test_the_engine_gets_two_cores_and_the_clients_the_rest() -> None:
    assert gpu_tinker.split_cpus(list(range(16))) == ("0,1", ",".join(map(str, range(2, 16))))
    assert gpu_tinker.split_cpus([0, 1, 2]) == ("0", "1,2")
    assert gpu_tinker.split_cpus([4, 5]) == ("4", "5")
    assert gpu_tinker.split_cpus([0]) is None
    assert tinker_clock.cpu_list("0-1,4") == {0, 1, 4} and tinker_clock.cpu_list("") is None


def test_the_serve_dtype_decides_the_tolerances() -> None:
    assert report.engine_dtype("cpu", None) == "float32"
    assert report.engine_dtype("cuda", None) == report.engine_dtype("cuda:0", None) == "bfloat16"
    assert report.engine_dtype("cuda", "float32") == "float32"
    assert report.TOLERANCES["bfloat16"]["adapter_max_steps"] is None  # not judged in bf16


def _adapter(path: Path, scale: float) -> Path:
    path.mkdir(parents=True)
    weights = {"a.lora_A.weight": torch.full((2, 4), 0.01), "a.lora_B.weight": torch.full(
        (4, 2), scale)}  # fmt: skip
    save_file(weights, str(path / "adapter_model.safetensors"))
    return path


@pytest.mark.parametrize(
    ("dtype", "b_gap", "loss_gap", "ok"),
    [
        ("float32", 0.0, 0.0, True),
        ("float32", 1e-3, 0.0, False),  # 0.1 of a step: far past fp32's bound
        ("bfloat16", 1e-3, 0.0, True),  # within bf16's 0.1 step RMS
        ("bfloat16", 0.0, 0.05, False),  # 1 % of the loss: past one bf16 ulp (0.8 %)
    ],
)
def test_parity_judges_losses_and_adapters_by_dtype(
    tmp_path: Path, dtype: str, b_gap: float, loss_gap: float, ok: bool
) -> None:
    """lr 0.005 x 2 steps: one Adam step unit is 0.01; lora_B of 0.02 moved two units."""
    ref = {"losses": {"0": [5.0, 4.9]}, "adapters": {"0": str(_adapter(tmp_path / "r", 0.02))}}
    got = {"losses": {"0": [5.0, 4.9 + loss_gap]},
           "adapters": {"0": str(_adapter(tmp_path / "g", 0.02 + b_gap))}}  # fmt: skip
    parities = {"rows1-n1-0-fused": report.parity(got, ref, 0.005, 2, report.TOLERANCES[dtype])}
    verdict = report.verdict(parities, dtype)
    assert verdict["ok"] is ok and verdict["client_runs"] == 1
    assert verdict["max_rel_loss_diff"] == pytest.approx(loss_gap / 4.9)


def _run(arm: str, n: int, rep: int, tokens_per_s: float) -> dict:
    return {"arm": arm, "rows": 1, "n": n, "repeat": rep, "train_tokens_per_s": tokens_per_s,
            "steps_per_s": tokens_per_s / 31, "losses": {}, "adapters": {}}  # fmt: skip


def test_a_cell_cut_between_its_arms_has_no_ratio_and_the_summary_says_what_holds() -> None:
    runs = [_run("fused", 1, 0, 100), _run("per_model", 1, 0, 100),
            _run("fused", 8, 0, 900), _run("per_model", 8, 0, 300),
            _run("fused", 8, 1, 600)]  # fmt: skip
    ratios, _ = report.summarise(runs, 0.005, 2, report.TOLERANCES["float32"])
    assert report.ratio_by_rows(ratios) == {"rows 1": {"1": 1.0, "8": 3.0}}
    clock = {"complete": False, "config": {"device": "cuda", "model": "m"},
             "ratio_by_rows": report.ratio_by_rows(ratios), "parity_verdict": None,
             "engine_only": [{"rows": 1, "n": 8, "ratio": 4.2}], "skipped": []}  # fmt: skip
    summary = gpu_tinker.summary(clock)
    assert summary["target_3x_at_n8"] is True and not summary["complete"]
    assert summary["engine_only_ratio"] == {"rows 1": 4.2}
    assert "error" in gpu_tinker.summary(None)
