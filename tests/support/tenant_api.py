"""A tenant's side of a live engine's HTTP API: a small spec, PUT, status, waiting for
Failed, and the engine flags that keep a tenant's attacks cheap (`LIMITS`)."""

from __future__ import annotations

from typing import Any

import httpx

from tests.support.server_process import wait_until

LIMITS = ["--max-prompt-tokens", "64", "--max-step-tokens", "10000"]


TARGETS = ["q_proj", "v_proj", "lm_head"]


def spec(
    task: dict[str, Any] | None = None,
    *,
    group: int = 4,
    prompts: int = 2,
    new_tokens: int = 4,
    every: int = 2,
) -> dict[str, Any]:
    """A spec the tiny model steps in tens of milliseconds (maxSteps 0: runs until deleted)."""
    return {
        "lora": {"rank": 4, "alpha": 8, "targetModules": TARGETS},
        "task": task or {"name": "target-token", "params": {"target": "yes"}},
        "algorithm": {
            "groupSize": group,
            "promptsPerStep": prompts,
            "learningRate": 0.05,
            "maxSteps": 0,
        },
        "rollout": {"maxNewTokens": new_tokens, "temperature": 1.0},
        "checkpoint": {"everySteps": every, "keep": 2},
    }


def put(api: httpx.Client, exp_id: str, body_spec: dict[str, Any], **extra: Any) -> httpx.Response:
    namespace, name = exp_id.split(".", 1)
    body = {"spec": body_spec, "namespace": namespace, "name": name, **extra}
    return api.put(f"/v1/experiments/{exp_id}", json=body)


def status(api: httpx.Client, exp_id: str) -> dict[str, Any]:
    r = api.get(f"/v1/experiments/{exp_id}")
    assert r.status_code == 200, r.text
    return r.json()


def failed(api: httpx.Client, exp_id: str, timeout: float = 60) -> dict[str, Any]:
    return wait_until(
        lambda: (s := status(api, exp_id))["phase"] == "Failed" and s, timeout=timeout
    )


def environment_spec(
    task: dict,
    *,
    steps: int = 0,
    seed: int = 0,
    new_tokens: int = 8,
    lr: float = 0.05,
    group: int = 8,
    prompts: int = 4,
) -> dict:
    return {
        "lora": {"rank": 8, "alpha": 16, "targetModules": TARGETS},
        "task": task,
        "algorithm": {
            "groupSize": group,
            "promptsPerStep": prompts,
            "learningRate": lr,
            "maxSteps": steps,
            "seed": seed,
        },
        "rollout": {"maxNewTokens": new_tokens, "temperature": 1.0},
        "checkpoint": {"everySteps": 10, "keep": 2},
    }


def wait_steps(api: httpx.Client, exp_id: str, steps: int, timeout: float = 600) -> dict:
    return wait_until(lambda: (s := status(api, exp_id))["step"] >= steps and s, timeout=timeout)
