"""The kmock API server of the e2e harness answers like the real one where our scenarios
rely on it: schema and CEL on create, and on a spec patch (transition rules against the
stored object). Fast: no operator, no engines."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import kmock
import pytest
from builders import experiment
from harness import ENGINE_NS, ApiServer, Harness, declare_resources
from loraplex_operator.kube import EXPERIMENTS, PODS, Kube, KubeError


@pytest.fixture
async def kube() -> AsyncIterator[Kube]:
    api = ApiServer()
    declare_resources(api)
    async with api, kmock.Server(api) as server:
        client = Kube(str(server.url).rstrip("/"), user_agent="loraplex-tests")
        try:
            yield client
        finally:
            await client.close()


async def test_spec_patch_is_checked_against_the_stored_object(kube: Kube) -> None:
    obj = experiment("a").rank(4).alpha(8).algorithm(maxSteps=500).obj()
    await kube.create(EXPERIMENTS, obj, "team-a")

    with pytest.raises(KubeError, match=r"422: .*spec\.lora is immutable once created"):
        await kube.patch(EXPERIMENTS, "a", {"spec": {"lora": {"rank": 8}}}, "team-a")
    with pytest.raises(KubeError, match=r"422: .*spec\.algorithm is immutable once created"):
        await kube.patch(EXPERIMENTS, "a", {"spec": {"algorithm": None}}, "team-a")  # defaulted
    await kube.patch(EXPERIMENTS, "a", {"spec": {"priority": 3, "suspend": True}}, "team-a")
    # kopf's metadata patches and status writes are not spec edits
    await kube.patch(EXPERIMENTS, "a", {"metadata": {"finalizers": ["x/y"]}}, "team-a")
    await kube.patch(EXPERIMENTS, "a", {"status": {"phase": "Running"}}, "team-a", "status")

    stored = await kube.get(EXPERIMENTS, "a", "team-a")
    assert stored is not None
    assert stored["spec"]["lora"]["rank"] == 4 and stored["spec"]["algorithm"]["maxSteps"] == 500
    assert (stored["spec"]["priority"], stored["spec"]["suspend"]) == (3, True)
    assert stored["status"]["phase"] == "Running"


async def test_create_is_checked(kube: Kube) -> None:
    with pytest.raises(KubeError, match=r"422: .*lora\.alpha must be at most 16"):
        await kube.create(EXPERIMENTS, experiment("b").rank(1).alpha(64).obj(), "team-a")
    assert await kube.get(EXPERIMENTS, "b", "team-a") is None


async def _scheduled_pod(kube: Kube, name: str) -> None:
    pod = {"metadata": {"name": name, "namespace": ENGINE_NS}, "spec": {"nodeName": "n"}}
    await kube.create(PODS, pod, ENGINE_NS)


async def test_kill_engine_on_a_real_cluster_deletes_the_pod_without_grace(
    kube: Kube, tmp_path: Path
) -> None:
    # A graceful delete would let the engine checkpoint on SIGTERM: not the crash that
    # the kill scenario is about. kmock honours gracePeriodSeconds as the API server does.
    await _scheduled_pod(kube, "drained")
    await kube.delete(PODS, "drained", ENGINE_NS)
    drained = await kube.get(PODS, "drained", ENGINE_NS)
    assert drained is not None and drained["metadata"]["deletionTimestamp"]

    await _scheduled_pod(kube, "killed")
    h = Harness(tmp_path, tmp_path, real_cluster=True)  # not entered: no operator
    h.kube = kube
    await h.kill_engine("killed")
    assert await kube.get(PODS, "killed", ENGINE_NS) is None
