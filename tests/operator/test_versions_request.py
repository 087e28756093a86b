"""Publishing through the Kubernetes API (docs/versions.md "When a version is
published"): the real operator against kmock and a real engine process on the tiny
model. A `kubectl patch` of spec.publish.requestToken publishes one version; an edit that
keeps the token publishes none (the operator pushes the whole block again)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from harness import ENGINE_NS, TOKEN_SECRET, Harness

pytestmark = pytest.mark.slow

NS = "team-a"
NAME = "asked"


@pytest.fixture
async def h(tmp_path, tiny_model_dir):
    async with Harness.create(tmp_path, tiny_model_dir) as harness:
        yield harness


async def _engine_status(h: Harness) -> dict[str, Any]:
    from loraplex_operator.manifests import engine_url

    (pod,) = await h.engine_pods("pr")
    token = await h.kube.secret_value(ENGINE_NS, TOKEN_SECRET, "token")  # type: ignore[union-attr]
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.get(
            f"{engine_url(pod)}/v1/experiments/{NS}.{NAME}",
            headers={"Authorization": f"Bearer {token}"},
        )
        r.raise_for_status()
        return r.json()


async def test_a_request_token_patch_publishes_one_version(h: Harness) -> None:
    await h.apply(h.pool_obj("pr", slots=2, replicas=(0, 1)))
    obj = h.experiment_obj(NAME, "pr", max_steps=0, every=50)
    obj["spec"]["publish"] = {"keep": 20}  # no everySteps: nothing publishes by itself
    await h.apply(obj)

    async def running() -> dict[str, Any] | None:
        s = await h.status(NS, NAME)
        return s if s.get("phase") == "Running" and s.get("step", 0) >= 1 else None

    await h.wait_for("running", running, timeout=240)
    assert (await _engine_status(h))["versions"] == []
    await h.patch_spec(NS, NAME, {"publish": {"requestToken": "release-1"}})

    async def published() -> dict[str, Any] | None:
        s = await h.status(NS, NAME)
        return s if len(s.get("versions") or []) == 1 else None

    s = await h.wait_for("the requested version", published, timeout=60)
    assert s["aliases"]["latest"] == "v1"
    engine = await _engine_status(h)
    assert engine["publishRequestToken"] == "release-1"
    assert [v["requestToken"] for v in engine["versions"]] == ["release-1"]

    # Another edit of the block, the same token: pushed again, applied, nothing published.
    await h.patch_spec(NS, NAME, {"publish": {"keep": 19}})

    async def applied() -> dict[str, Any] | None:
        e = await _engine_status(h)
        return e if (e.get("publish") or {}).get("keep") == 19 else None

    engine = await h.wait_for("the keep edit on the engine", applied, timeout=60)
    assert [v["version"] for v in engine["versions"]] == ["v1"]
    # A new token: one more version.
    await h.patch_spec(NS, NAME, {"publish": {"requestToken": "release-2"}})

    async def second() -> dict[str, Any] | None:
        e = await _engine_status(h)
        return e if e.get("publishRequestToken") == "release-2" else None

    engine = await h.wait_for("the second request", second, timeout=60)
    assert [(v["version"], v["requestToken"]) for v in engine["versions"]] == [
        ("v1", "release-1"),
        ("v2", "release-2"),
    ]
