"""AIBrix ModelAdapters for published aliases (docs/versions.md, "AIBrix"): the real
operator, rendered by the chart with `aibrix.enabled`, against kmock (which has AIBrix's
ModelAdapter resource, as a cluster with AIBrix does) and a real engine training a
continual experiment on the tiny model. Each alias gets a ModelAdapter owned by the
LoRAExperiment whose artifactURL is the directory of the version it points at; a
promotion by the gate and a rollback by `kubectl patch` move it; an alias added by hand
creates one and removing it deletes it. Off (the default), none is created and the
operator makes no AIBrix call. There is no garbage collector in kmock: that deleting the
experiment deletes its ModelAdapters rests on the ownerReference checked here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from loraplex_engine.store.versions import VersionStore
from loraplex_operator.aibrix import MODEL_ADAPTERS, artifact_url

from tests.support.harness import Harness, operator_calls_in

pytestmark = pytest.mark.slow

NS, NAME = "team-a", "cont"
SELECTOR = {"model.aibrix.ai/name": "tiny"}
ROOT = "/mnt/loraplex"  # where the AIBrix-managed vLLM pods mount the checkpoint volume
CONTRACT_VERBS = {"list", "create", "patch", "delete"}  # rbac-contract.yaml's aibrix rule


def _publishing(h: Harness) -> dict[str, Any]:
    obj = h.experiment_obj(NAME, "pa", max_steps=0, every=50)
    # Every version passes the gate; v1 pinned, so the rollback target outlives retention.
    obj["spec"]["publish"] = {
        "everySteps": 3,
        "keep": 20,
        "pinned": ["v1"],
        "promoteWhen": {"atLeast": -1.0},
    }
    return obj


async def _adapters(h: Harness) -> dict[str, dict[str, Any]]:
    assert h.kube is not None
    return {o["metadata"]["name"]: o for o in await h.kube.list(MODEL_ADAPTERS, NS)}


def _url(version: str) -> str:
    return f"{ROOT}/{NS}/{NAME}/_versions/{version}"


def test_the_artifact_path_is_the_engines_version_directory() -> None:
    """The operator's artifactURL names the directory the engine's VersionStore writes."""
    assert artifact_url(ROOT, NS, NAME, "v7") == str(VersionStore(Path(ROOT)).path(NS, NAME, 7))


async def test_modeladapters_follow_the_aliases(tmp_path, tiny_model_dir) -> None:
    values = {"aibrix": {"enabled": True, "podSelector": SELECTOR, "artifactRoot": ROOT,
                         "baseModel": "tiny"}}  # fmt: skip
    async with Harness(tmp_path, tiny_model_dir, chart_values=values) as h:
        await h.apply(h.pool_obj("pa", slots=2, replicas=(0, 1)))
        await h.apply(_publishing(h))

        async def stable_served() -> tuple[str, dict[str, Any]] | None:
            stable = ((await h.status(NS, NAME)).get("aliases") or {}).get("stable")
            adapter = (await _adapters(h)).get(f"{NAME}-stable")
            if stable and int(stable[1:]) >= 2 and adapter:
                return (stable, adapter) if adapter["spec"]["artifactURL"] == _url(stable) else None
            return None

        stable, adapter = await h.wait_for("stable's ModelAdapter", stable_served, timeout=240)
        assert adapter["spec"]["podSelector"] == {"matchLabels": SELECTOR}
        assert adapter["spec"]["baseModel"] == "tiny"
        assert adapter["metadata"]["labels"]["loraplex.dev/alias"] == "stable"
        uid = (await h.get(NS, NAME) or {})["metadata"]["uid"]
        (owner,) = adapter["metadata"]["ownerReferences"]
        assert owner == {"apiVersion": "loraplex.dev/v1alpha1", "kind": "LoRAExperiment",
                         "name": NAME, "uid": uid, "controller": True}  # fmt: skip
        assert f"{NAME}-latest" in await _adapters(h)

        # The gate promotes a newer version: the same ModelAdapter's artifact follows.
        async def promoted() -> str | None:
            now = ((await h.status(NS, NAME)).get("aliases") or {}).get("stable")
            adapter = (await _adapters(h)).get(f"{NAME}-stable") or {}
            url = (adapter.get("spec") or {}).get("artifactURL")
            return now if now and now != stable and url == _url(now) else None

        await h.wait_for("the promotion in the ModelAdapter", promoted, timeout=120)

        # Rollback by kubectl patch, and a canary by hand: patched, and created.
        aliases = [{"name": "stable", "version": "v1"}, {"name": "canary", "version": "v1"}]
        await h.patch_spec(NS, NAME, {"publish": {"aliases": aliases}})

        async def rolled_back() -> dict[str, dict[str, Any]] | None:
            found = await _adapters(h)
            urls = {n: (o.get("spec") or {}).get("artifactURL") for n, o in found.items()}
            wanted = {f"{NAME}-stable": _url("v1"), f"{NAME}-canary": _url("v1")}
            return found if wanted.items() <= urls.items() else None

        await h.wait_for("stable and canary at v1", rolled_back, timeout=60)

        # The canary removed from the spec: its ModelAdapter goes, stable's stays.
        await h.patch_spec(NS, NAME, {"publish": {"aliases": [aliases[0]]}})

        async def canary_gone() -> dict[str, dict[str, Any]] | None:
            found = await _adapters(h)
            return found if f"{NAME}-canary" not in found else None

        found = await h.wait_for("the canary's ModelAdapter deleted", canary_gone, timeout=60)
        assert found[f"{NAME}-stable"]["spec"]["artifactURL"] == _url("v1")

        assert h.api is not None
        used = {c[2] for c in operator_calls_in(h.api) if c[0] == "model.aibrix.ai"}
        assert used == CONTRACT_VERBS, "each verb of the aibrix RBAC rule is used, no other"


async def test_off_by_default_no_modeladapter(tmp_path, tiny_model_dir) -> None:
    async with Harness.create(tmp_path, tiny_model_dir) as h:
        await h.apply(h.pool_obj("pa", slots=2, replicas=(0, 1)))
        await h.apply(_publishing(h))

        async def stable() -> str | None:
            return ((await h.status(NS, NAME)).get("aliases") or {}).get("stable")

        await h.wait_for("a stable version", stable, timeout=240)
        await asyncio.sleep(2.5)  # two more operator rounds (LORAPLEX_RECONCILE_INTERVAL=1)
        assert await _adapters(h) == {}
        assert h.api is not None
        assert not [c for c in operator_calls_in(h.api) if c[0] == "model.aibrix.ai"]
