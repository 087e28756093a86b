"""The kmock API server of the e2e harness answers like the real one where our scenarios
rely on it: schema and CEL on create, and on a spec patch (transition rules against the
stored object), and Namespaces as a resource; and the Pod runtime of its kubelet maps
only what a node provides. Fast: no operator, no engines."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import kmock
import kmock._internal.dsl as kmock_dsl
import pytest
from loraplex_operator import manifests
from loraplex_operator.kube import EXPERIMENTS, NAMESPACES, PODS, Kube, KubeError
from loraplex_operator.resources import Pool

from tests.support import pod_runtime
from tests.support.builders import experiment
from tests.support.harness import ENGINE_NS, ApiServer, Harness, declare_resources


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
    with pytest.raises(KubeError, match=r"422: .*spec\.priority is no longer honoured"):
        await kube.patch(EXPERIMENTS, "a", {"spec": {"priority": 3}}, "team-a")
    patch = {"spec": {"priorityClassName": "high", "suspend": True}}
    await kube.patch(EXPERIMENTS, "a", patch, "team-a")
    # kopf's metadata patches and status writes are not spec edits
    await kube.patch(EXPERIMENTS, "a", {"metadata": {"finalizers": ["x/y"]}}, "team-a")
    await kube.patch(EXPERIMENTS, "a", {"status": {"phase": "Running"}}, "team-a", "status")

    stored = await kube.get(EXPERIMENTS, "a", "team-a")
    assert stored is not None
    assert stored["spec"]["lora"]["rank"] == 4 and stored["spec"]["algorithm"]["maxSteps"] == 500
    assert (stored["spec"]["priorityClassName"], stored["spec"]["suspend"]) == ("high", True)
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


async def test_namespaces_are_served_as_a_resource(kube: Kube) -> None:
    """kmock alone answers 500 on /api/v1/namespaces; kopf lists them in namespaced mode."""
    await kube.create(NAMESPACES, {"metadata": {"name": "team-z"}})
    assert (await kube.get(NAMESPACES, "team-z"))["metadata"]["name"] == "team-z"
    assert "team-z" in {n["metadata"]["name"] for n in await kube.list(NAMESPACES)}


def test_pod_runtime_maps_the_image_volumes_and_ports_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the kubelet runs for an engine Pod: the operator's command line, with the
    program, the model path, volume paths and the container port made local."""
    monkeypatch.setenv("LORAPLEX_TEST_ONLY", "1")
    pool = {
        "metadata": {"name": "p", "uid": "u1"},
        "spec": {
            "baseModel": "/models/m",
            "capacity": {"maxAdapters": 3, "maxRank": 8},
            "template": {"image": "engine:x", "env": [{"name": "A", "value": "/ckpt/a"}]},
            "tokenSecretRef": {"name": "tok", "key": "k"},
        },
    }
    pod = manifests.engine_pod(Pool.from_obj(pool), "abc")
    node = pod_runtime.Node(tmp_path, image_paths={"/models/m": tmp_path / "model"})
    secret = {"k": base64.b64encode(b"s3cret").decode()}
    volumes = node.volume_dirs(pod, lambda ns, name: secret if name == "tok" else None)
    container = pod["spec"]["containers"][0]
    mapped = node.path_map(container, volumes)
    argv = pod_runtime.local_command(container, mapped)
    env = pod_runtime.local_env(pod_runtime.container_env(pod, container), mapped)
    token = volumes[manifests.TOKEN_VOLUME] / "token"
    assert token.read_text() == "s3cret" and token.stat().st_mode & 0o777 == 0o400
    ckpt = volumes[manifests.CHECKPOINT_VOLUME]
    want = [str(pod_runtime.VENV_BIN / "loraplex-engine"), *container["args"]]
    want = [{"/models/m": str(tmp_path / "model"), manifests.TOKEN_FILE: str(token),
             "/ckpt": str(ckpt), "8000": "0"}.get(a, a) for a in want]  # fmt: skip
    assert argv == want
    assert env["A"] == f"{ckpt}/a" and env["LORAPLEX_ENGINE"] == "p-engine-abc"
    assert "LORAPLEX_TEST_ONLY" not in env  # nothing of the test process leaks in
    with pytest.raises(pod_runtime.PodSpecError, match="Secret tok not found"):
        node.volume_dirs(pod, lambda ns, name: None)


async def test_a_request_is_matched_by_itself_not_by_the_whole_history(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kmock filters every recorded request to pick a reaction (quadratic: it saturated
    the request-rate bench); the harness's server checks only the request at hand, and
    still lists every request afterwards."""
    checked = 0
    original = kmock_dsl.Filter.__iter__

    def counting(self: Any) -> Any:
        for request in kmock_dsl.Chained.__iter__(self):
            nonlocal checked
            checked += 1
            if self.criteria(request):
                yield request

    monkeypatch.setattr(kmock_dsl.Filter, "__iter__", counting)
    api = ApiServer()
    declare_resources(api)
    async with api, kmock.Server(api) as server:
        client = Kube(str(server.url).rstrip("/"), user_agent="loraplex-tests")
        try:
            costs = []
            for i in range(60):
                before = checked
                await client.create(NAMESPACES, {"metadata": {"name": f"ns-{i}"}})
                costs.append(checked - before)
        finally:
            await client.close()
    monkeypatch.setattr(kmock_dsl.Filter, "__iter__", original)
    assert costs[-1] == costs[0] > 0
    assert len([r for r in api if r.action == kmock.action.CREATE]) == 60


async def test_a_sliced_reaction_still_sees_the_history() -> None:
    """`[:1]` depends on earlier requests: with such a reaction the server matches over
    the whole history, as kmock does."""
    api = ApiServer()
    declare_resources(api)
    api["get /version"][:1] << {"gitVersion": "first"}
    async with api, kmock.Server(api) as server:
        http = httpx.AsyncClient(base_url=str(server.url))
        first = (await http.get("/version")).json()
        second = (await http.get("/version")).json()
        await http.aclose()
    assert first == {"gitVersion": "first"}
    assert second["gitVersion"] != "first"


async def test_every_write_gets_a_new_resource_version(kube: Kube) -> None:
    """kopf tells its own patch's event from stale ones by resourceVersion: each create and
    patch (status too) answers with a version no earlier write had."""
    created = await kube.create(EXPERIMENTS, experiment("v").obj(), "team-a")
    patched = await kube.patch(EXPERIMENTS, "v", {"metadata": {"labels": {"a": "b"}}}, "team-a")
    phase = {"status": {"phase": "Pending"}}
    status = await kube.patch(EXPERIMENTS, "v", phase, "team-a", "status")
    versions = [int(o["metadata"]["resourceVersion"]) for o in (created, patched, status)]
    assert versions == sorted(set(versions)), versions
    stored = await kube.get(EXPERIMENTS, "v", "team-a")
    assert stored is not None and stored["metadata"]["resourceVersion"] == str(versions[-1])


def test_the_kubelet_restarts_containers_as_the_restart_policy_says() -> None:
    from tests.support.kubelet import crash_backoff, restarts_after

    def pod(policy: str | None) -> dict[str, Any]:
        return {"spec": {"restartPolicy": policy} if policy else {}}

    assert restarts_after(pod(None), 0) and restarts_after(pod("Always"), 0)  # the default
    assert restarts_after(pod("OnFailure"), 1) and restarts_after(pod("OnFailure"), -9)
    assert not restarts_after(pod("OnFailure"), 0) and not restarts_after(pod("Never"), 1)
    assert manifests.engine_pod(Pool.from_obj(_POOL), "x")["spec"]["restartPolicy"] == "Always"
    # The kubelet's back-off: the first restart at once, then 10 s doubling to 300 s.
    assert [crash_backoff(n) for n in (1, 2, 3, 4, 7, 8)] == [0, 10, 20, 40, 300, 300]


_POOL = {
    "metadata": {"name": "p", "uid": "u"},
    "spec": {
        "baseModel": "/m",
        "template": {"image": "engine"},
        "tokenSecretRef": {"name": "engine-token"},
    },
}
