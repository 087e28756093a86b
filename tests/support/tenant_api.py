"""A tenant's side of a live engine's HTTP API: a small spec, PUT, status, waiting for
Failed, and the engine flags that keep a tenant's attacks cheap (`LIMITS`)."""

from __future__ import annotations

from typing import Any

import httpx

from tests.support.server_process import wait_until
from tests.support.spec_bodies import spec_body

LIMITS = ["--max-prompt-tokens", "64", "--max-step-tokens", "10000"]


# A spec the tiny model steps in tens of milliseconds (maxSteps 0: runs until deleted).
TENANT_SPEC: dict[str, Any] = dict(
    rank=4, group=4, prompts=2, lr=0.05, steps=0, new_tokens=4, every=2, keep=2
)
# An environment's: rank 8, a seed, checkpoints every 10 steps.
ENVIRONMENT_SPEC: dict[str, Any] = dict(
    rank=8, group=8, prompts=4, lr=0.05, steps=0, new_tokens=8, every=10, keep=2, seed=0
)


def spec(task: dict[str, Any] | None = None, **numbers: Any) -> dict[str, Any]:
    """``TENANT_SPEC`` with ``numbers`` (``spec_body``'s keywords) over it."""
    return spec_body(task, **(TENANT_SPEC | numbers))


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


def environment_spec(task: dict[str, Any], **numbers: Any) -> dict[str, Any]:
    """``ENVIRONMENT_SPEC`` with ``numbers`` (``spec_body``'s keywords) over it."""
    return spec_body(task, **(ENVIRONMENT_SPEC | numbers))


def wait_steps(api: httpx.Client, exp_id: str, steps: int, timeout: float = 600) -> dict:
    return wait_until(lambda: (s := status(api, exp_id))["step"] >= steps and s, timeout=timeout)
