"""The gateway's allowlist in the Kubernetes-directory mode (KubeDirectory, Tinker models
as experiments): the gateway process as the chart renders it (deployed_gateway.py)
reads the kmock API server (a pool, its token Secret, an engine pod whose URL is a real
``loraplex-engine serve`` process, key Secrets), and team-a's sample key sends the raw
dot-segment, percent-encoded and control-character paths of
tests/engine/server/test_gateway_paths_live.py. Each is refused by the gateway; the engine's
access log shows no request outside the gateway's routes, and the gateway touched no
LoRAExperiment.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest
import yaml
from loraplex_operator import manifests
from loraplex_operator.gateway import experiments as gx
from loraplex_operator.gateway.keys import KEY_LABEL, ROLE_LABEL
from loraplex_operator.kube import NAMESPACES, PODS, POOLS, SECRETS, Kube

from tests.support import builders
from tests.support.deployed_gateway import GatewayContainer, gateway_values, rendered_gateway
from tests.support.gateway_attacks import (
    FORWARDED,
    KEY_A_RO,
    KEY_B,
    OPENAI_ATTACKS,
    engine_requests,
    refusal,
    send_raw,
    tinker_attacks,
)
from tests.support.harness import ApiServer, _kubeconfig, declare_resources
from tests.support.server_process import EngineServer

pytestmark = pytest.mark.slow

ENGINE_NS, POOL = "engines", "gw-pool"
TOKEN = "engine-token-" + "k" * 24


@pytest.fixture(scope="module")
def engine(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    work = tmp_path_factory.mktemp("gw-kube-engine")
    with EngineServer(
        tiny_model_dir, work / "ckpt", max_adapters=2, workdir=work, token=TOKEN
    ) as srv:
        yield srv


async def _seed(kube: Kube, engine_url: str) -> None:
    for ns in (ENGINE_NS, "team-a", "team-b"):
        await kube.create(NAMESPACES, {"metadata": {"name": ns}})
    token = {"token": base64.b64encode(TOKEN.encode()).decode()}
    await kube.create(
        SECRETS,
        {"metadata": {"name": "engine-token", "namespace": ENGINE_NS}, "data": token},
        ENGINE_NS,
    )
    for ns, key, role in (("team-a", KEY_A_RO, "sample"), ("team-b", KEY_B, "train")):
        meta = {"name": "key", "namespace": ns, "labels": {KEY_LABEL: "true", ROLE_LABEL: role}}
        await kube.create(SECRETS, {"metadata": meta, "stringData": {"key": key}}, ns)
    pool = builders.pool(POOL).obj()
    pool["spec"]["engineNamespace"] = ENGINE_NS
    pool["spec"]["tokenSecretRef"] = {"name": "engine-token", "key": "token"}
    await kube.create(POOLS, pool)
    meta: dict[str, Any] = {"name": f"{POOL}-engine-0", "namespace": ENGINE_NS}
    meta["labels"] = {manifests.POOL_LABEL: POOL}
    meta["annotations"] = {manifests.ENGINE_URL_ANNOTATION: engine_url}
    status = {"phase": "Running", "podIP": "127.0.0.1"}
    status["conditions"] = [{"type": "Ready", "status": "True"}]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status}
    pod["spec"] = {"containers": [{"name": "engine", "image": "engine:test"}]}
    await kube.create(PODS, pod, ENGINE_NS)


def _experiment_calls(api: kmock.KubernetesEmulator) -> list[str]:
    return [
        f"{req.action} {req.namespace}/{req.name}"
        for req in list(api)
        if req.resource is not None and req.resource.plural == "loraexperiments"
    ]


async def test_the_kube_mode_gateway_refuses_what_is_not_a_route(
    engine: EngineServer, tmp_path: Path
) -> None:
    async with ApiServer() as api:
        declare_resources(api)
        async with kmock.Server(api) as server:
            url = str(server.url).rstrip("/")
            seeder = Kube(url, user_agent="loraplex-tests")
            try:
                await _seed(seeder, engine.url)
            finally:
                await seeder.close()
            kubeconfig = tmp_path / "kubeconfig"
            kubeconfig.write_text(yaml.safe_dump(_kubeconfig(url)))
            pod, container = rendered_gateway(gateway_values())
            gw = GatewayContainer(pod, container, kubeconfig, tmp_path)
            await asyncio.to_thread(gw.start)
            try:
                outcome = await _attacks(gw.url, engine, api)
            finally:
                gw.stop()
    assert gx.SESSION.fullmatch(outcome.session), outcome.session  # the Kubernetes mode
    assert outcome.answered == [], f"attacks not refused: {outcome.answered}"
    assert outcome.reached == [], f"the engine was called outside the routes: {outcome.reached}"
    assert outcome.experiment_calls == [], "an attack reached the LoRAExperiment API"


@dataclass
class Outcome:
    """What the attacks got: the gateway's session, the attacks it did not refuse, the
    engine requests outside its routes and the LoRAExperiment calls they caused."""

    session: str
    answered: list[tuple[str, str, int]]
    reached: list[Any]
    experiment_calls: list[str]


async def _attacks(url: str, engine: EngineServer, api: kmock.KubernetesEmulator) -> Outcome:
    a = {"X-API-Key": KEY_A_RO, "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=url, headers=a, timeout=60) as http:
        r = await http.post("/api/v1/create_session", json={})  # the gateway's own session
        assert r.status_code == 200, r.text
        sid = r.json()["session_id"]
    before, since = len(_experiment_calls(api)), len(engine.log_text())
    answered = []
    for method, target in tinker_attacks(sid) + OPENAI_ATTACKS:
        status, body = await asyncio.to_thread(send_raw, url, method, target.encode(), a, b"{}")
        if not refusal(status, body):
            answered.append((method, target, status))
    reached = [(m, p, s) for m, p, s in engine_requests(engine, since) if not FORWARDED.match(p)]
    return Outcome(sid, answered, reached, _experiment_calls(api)[before:])
