"""A client experiment's ``spec.client.modelId`` is its own, end to end: the real operator
process, the kmock API server, and a real engine process the test kubelet runs.

team-b's model (named as the gateway names it) trains on the pool's engine; team-a
applies a LoRAExperiment of its own naming team-b's model id (learnable from an engine's
series): the operator refuses it (``Admitted=False`` naming ``spec.client.modelId``, an
``AdmissionFailed`` Event), it never reaches the engine, and team-b's model still answers
its namespace. team-a's own experiment under the gateway's name for the same id, in its
own namespace, is admitted beside it: on the engine both are keyed by namespace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.harness import ENGINE_NS, TOKEN_SECRET, Harness

pytestmark = pytest.mark.slow

SESSION = "s" + "b" * 20
MODEL_ID = f"{SESSION}:train:0"
GATEWAY_NAME = f"tinker-{SESSION}-0"


@pytest.fixture
async def h(tmp_path: Path, tiny_model_dir: Path):
    async with Harness.create(tmp_path, tiny_model_dir) as harness:
        yield harness


def client_experiment(name: str, namespace: str, model_id: str) -> dict[str, Any]:
    return {
        "apiVersion": "loraplex.dev/v1alpha1",
        "kind": "LoRAExperiment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "enginePool": "pool-c",
            "lora": {"rank": 2},
            "client": {"modelId": model_id, "trainUnembed": False},
            "algorithm": {"maxSteps": 0},
            "checkpoint": {"everySteps": 1, "keep": 2},
        },
    }


async def _get_info(h: Harness, engine_pod: str, ns: str) -> int:
    from loraplex_operator.manifests import engine_url

    assert h.kube is not None
    token = await h.kube.secret_value(ENGINE_NS, TOKEN_SECRET, "token")
    pod = next(p for p in await h.engine_pods("pool-c") if p["metadata"]["name"] == engine_pod)
    headers = {"Authorization": f"Bearer {token}", "X-Loraplex-Namespace": ns}
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(
            f"{engine_url(pod)}/api/v1/get_info", json={"model_id": MODEL_ID}, headers=headers
        )
    return r.status_code


async def test_a_squatting_client_experiment_is_refused_and_takes_nothing(h: Harness) -> None:
    await h.apply(h.pool_obj("pool-c", slots=4, replicas=(1, 1)))
    await h.apply(client_experiment(GATEWAY_NAME, "team-b", MODEL_ID))
    running = await h.wait_phase("team-b", GATEWAY_NAME, "Running", timeout=240)
    engine = running["engine"]

    await h.apply(client_experiment("squat", "team-a", MODEL_ID))

    async def refused() -> dict[str, Any] | None:
        s = await h.status("team-a", "squat")
        adm = next((c for c in s.get("conditions", []) if c["type"] == "Admitted"), {})
        return adm if adm.get("status") == "False" else None

    adm = await h.wait_for("squat refused", refused, timeout=60)
    assert "spec.client.modelId" in adm["message"] and MODEL_ID in adm["message"]
    assert "'squat:train:<n>'" in adm["message"]
    s = await h.status("team-a", "squat")
    assert s.get("phase") == "Pending" and not s.get("engine")
    # the same id under the name the gateway gives it, in team-a's namespace: its own model
    await h.apply(client_experiment(GATEWAY_NAME, "team-a", MODEL_ID))
    await h.wait_phase("team-a", GATEWAY_NAME, "Running", timeout=120)
    assert await _get_info(h, engine, "team-a") == 200  # team-a adopts its own first
    assert await _get_info(h, engine, "team-b") == 200
    assert (await h.status("team-b", GATEWAY_NAME))["phase"] == "Running"
