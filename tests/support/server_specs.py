"""Experiment specs and PUT bodies for a live `loraplex-engine serve` with the tiny model:
small enough that a step takes tens of milliseconds."""

from __future__ import annotations

from typing import Any

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def small_spec(
    target: str = "yes", *, seed: int = 0, rank: int = 4, max_steps: int = 0, **algorithm: Any
) -> dict[str, Any]:
    """A spec the tiny model trains in tens of milliseconds per step."""
    return {
        "lora": {"rank": rank, "alpha": 2 * rank, "targetModules": list(TARGET_MODULES)},
        "task": {"name": "target-token", "params": {"target": target}},
        "algorithm": {
            "groupSize": 4,
            "promptsPerStep": 2,
            "learningRate": 0.05,
            "maxSteps": max_steps,
            "seed": seed,
            **algorithm,
        },
        "rollout": {"maxNewTokens": 4, "temperature": 1.0},
        "checkpoint": {"everySteps": 2, "keep": 2},
    }


def put_body(
    exp_id: str, spec: dict[str, Any], resume_from: str | None = None, run_id: str | None = None
) -> dict:
    namespace, name = exp_id.split(".", 1)
    body = {"spec": spec, "namespace": namespace, "name": name, "resumeFrom": resume_from}
    return body | ({"runId": run_id} if run_id is not None else {})
