"""Publishing through the Kubernetes API (docs/versions.md "When a version is
published"): the real operator against kmock and a real engine process on the tiny
model. A `kubectl patch` of spec.publish.requestToken publishes one version; an edit that
keeps the token publishes none (the operator pushes the whole block again). The gate here
is one no version passes: the LoRAExperiment's status carries the version's eval step,
scores, gate note and request token, and `publishRequestToken` (the GitOps user's "my
publish landed"), and a `VersionGateFailed` Event says why, once per version."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.harness import ENGINE_NS, TOKEN_SECRET, Harness

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
    obj["spec"]["eval"] = {"everySteps": 2, "prompts": 2}
    # No everySteps: nothing publishes by itself. A gate on the eval's mean reward (at
    # most 1 for target-token) that no version passes.
    obj["spec"]["publish"] = {"keep": 20, "promoteWhen": {"score": "evalReward", "atLeast": 5.0}}
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
    assert s["aliases"]["latest"] == "v1" and "stable" not in s["aliases"]
    engine = await _engine_status(h)
    assert engine["publishRequestToken"] == "release-1"
    assert [v["requestToken"] for v in engine["versions"]] == ["release-1"]
    # The object's status: what the engine reports, the same version's fields.
    assert s["publishRequestToken"] == "release-1"
    (v1,) = s["versions"]
    (e1,) = engine["versions"]
    assert v1["requestToken"] == "release-1" and v1["gatePassed"] is False
    assert v1["evalStep"] == e1["evalStep"] is not None and v1["evalStep"] <= v1["step"]
    assert v1["scores"]["evalReward"] == e1["scores"]["evalReward"] <= 1.0
    assert v1["gateNote"] == e1["gateNote"]
    assert v1["gateNote"].startswith("evalReward ") and "< promoteWhen.atLeast 5" in v1["gateNote"]
    published_cond = next(c for c in s["conditions"] if c["type"] == "Published")
    assert published_cond["status"] == "True"
    assert f"v1 failed its gate: {v1['gateNote']}" in published_cond["message"]

    async def gate_event() -> list[dict[str, Any]] | None:
        found = [e for e in await h.events(NS, NAME) if e.get("reason") == "VersionGateFailed"]
        return found or None

    (event,) = await h.wait_for("the VersionGateFailed event", gate_event, timeout=30)
    assert event["type"] == "Warning"
    assert event["message"] == f"v1 failed its gate: {v1['gateNote']}"

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

    async def landed() -> dict[str, Any] | None:
        s = await h.status(NS, NAME)
        return s if s.get("publishRequestToken") == "release-2" else None

    s = await h.wait_for("release-2 in the object's status", landed, timeout=60)
    assert [(v["version"], v["requestToken"]) for v in s["versions"]] == [
        ("v1", "release-1"),
        ("v2", "release-2"),
    ]
    # One Event per version that failed its gate, however many rounds have passed.
    await h.wait_for("v2's event", lambda: _gate_events(h, 2), timeout=30)
    events = await _gate_events(h, 2)
    assert events is not None
    assert sorted(e["message"].split()[0] for e in events) == ["v1", "v2"]
    assert all(e.get("count", 1) == 1 for e in events)


async def _gate_events(h: Harness, n: int) -> list[dict[str, Any]] | None:
    found = [e for e in await h.events(NS, NAME) if e.get("reason") == "VersionGateFailed"]
    return found if len(found) >= n else None
