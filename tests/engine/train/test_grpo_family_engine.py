"""The GRPO family in the real engine (the tiny model): experiments with different
algorithms train together in one fused step, each exactly as it would alone, and a step
whose every group dynamic sampling drops updates nothing and says so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from loraplex_engine.metrics import EngineMetrics
from loraplex_engine.spec.experiment import parse_spec

from tests.support.adapter_parity import adapter_gap, assert_same_training
from tests.support.engine_builders import engine, run_to_end, spec

STEPS = 8
LR = 0.02
# Two members of the family side by side, on the target-token task (dense reward).
ALGORITHMS: dict[str, dict[str, Any]] = {
    # DAPO: clip-higher, token-mean, dynamic sampling, overlong shaping over the last
    # 3 of the 8 new tokens.
    "default.dapo": {
        "clipHigh": 0.28,
        "lossAggregation": "token-mean",
        "dynamicSampling": True,
        "overlong": {"bufferTokens": 3, "penalty": 0.5},
    },
    # GSPO's sequence ratio with RLOO advantages, Dr. GRPO's aggregation and a k1 KL.
    "default.gspo-rloo": {
        "importanceSamplingLevel": "sequence",
        "advantageEstimator": "rloo",
        "scaleRewards": "none",
        "lossAggregation": "seq-mean-token-sum-norm",
        "klCoef": 0.05,
        "klEstimator": "k1",
    },
}
TASK = {"name": "target-token", "params": {"target": "yes"}}


def _put(eng: Any, exp_id: str, algorithm: dict[str, Any], task: dict[str, Any] = TASK) -> None:
    s = spec(task, lr=LR, steps=STEPS, group=4, prompts=2)
    body = s.to_json()
    body["algorithm"] = {**body["algorithm"], **algorithm}
    eng.put_experiment(exp_id, parse_spec(body), "default", exp_id.split(".", 1)[1])


@pytest.fixture(scope="module")
def fused(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    eng = engine(tiny_model_dir, tmp_path_factory.mktemp("family"))
    for exp_id, algorithm in ALGORITHMS.items():
        _put(eng, exp_id, algorithm)
    yield eng, run_to_end(eng, list(ALGORITHMS))
    eng.close()


def test_two_algorithms_train_together_as_each_would_alone(
    fused, tiny_model_dir: Path, tmp_path: Path
) -> None:
    eng_fused, curves = fused
    gaps = {}
    for exp_id, algorithm in ALGORITHMS.items():
        status = eng_fused.get_experiment(exp_id)
        assert status.phase == "Succeeded" and status.step == STEPS, (exp_id, status.error)
        eng = engine(tiny_model_dir, tmp_path / exp_id.split(".")[1])
        _put(eng, exp_id, algorithm)
        try:
            alone = run_to_end(eng, [exp_id])[exp_id]
            mine = eng.model.adapter_state_dict(exp_id)
        finally:
            eng.close()
        # Same seeds, same samples: the other tenant's rows change only float rounding
        # (see test_engine_rl.py's fused-vs-alone test for why the curves stay equal).
        assert alone == pytest.approx(curves[exp_id], abs=1e-6), exp_id
        theirs = eng_fused.model.adapter_state_dict(exp_id)
        gaps[exp_id] = adapter_gap(mine, theirs, LR, STEPS)
    # Each adapter moved (assert_same_training refuses one that did not) and matches.
    assert_same_training(gaps)


def test_the_two_algorithms_give_different_updates(fused) -> None:
    """Guards the test above against comparing one algorithm with itself: both
    experiments share seed, task and so their first samples; only their settings differ,
    and their adapters end apart."""
    eng, _ = fused
    a, b = (eng.model.adapter_state_dict(e) for e in ALGORITHMS)
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 1e-4


def test_a_step_with_every_group_dropped_skips_its_update(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # exact-match against 500 characters: 8 tokens of at most 52 characters never reach
    # it, so every reward is 0 and every group has zero variance.
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "say it", "answer": "q" * 500}) + "\n")
    task = {"name": "jsonl", "dataset": str(rows), "reward": "exact-match"}
    eng = engine(tiny_model_dir, tmp_path / "ckpt")
    metrics = EngineMetrics()
    try:
        _put(eng, "default.flat", {"dynamicSampling": True}, task)
        _put(eng, "default.other", ALGORITHMS["default.gspo-rloo"])
        before = {k: v.clone() for k, v in eng.model.adapter_state_dict("default.flat").items()}
        while (report := eng.tick()) is not None:
            metrics.observe_tick(report)
        flat = eng.get_experiment("default.flat")
        after = eng.model.adapter_state_dict("default.flat")
        other = eng.get_experiment("default.other")
        other_b = {
            k: v for k, v in eng.model.adapter_state_dict("default.other").items() if "lora_B" in k
        }
    finally:
        eng.close()
    assert flat.phase == "Succeeded" and flat.step == STEPS  # steps count, nothing fails
    assert flat.skipped_updates == STEPS and flat.to_json()["skippedUpdates"] == STEPS
    assert all(after[k].equal(before[k]) for k in before)  # no optimiser step at all
    # Its tenant (no dynamic sampling) trained on: every step an update, lora_B off zero.
    assert other.phase == "Succeeded" and other.skipped_updates == 0
    assert other_b and max(v.abs().max().item() for v in other_b.values()) > 0
    text = metrics.render().decode()
    per = 'experiment="default.flat",namespace="default"'
    assert f"loraplex_engine_updates_skipped_total{{{per}}} {float(STEPS)}" in text
    assert f"loraplex_engine_groups_dropped_total{{{per}}} {float(STEPS * 2)}" in text
