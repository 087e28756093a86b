"""Kueue-metered engines end to end: the real operator process, kmock, real engines.

A pool with `queueName` labels its engine Pods for Kueue; the harness's API server gates
such Pods as Kueue's webhook does and its kubelet does not start a gated Pod;
`Harness.release_gate` plays Kueue admitting one, and deleting the Pod plays Kueue
preempting it. Kueue itself cannot run here (it needs a real API server and its
controllers), so the gate is the whole contract under test: what the operator sees of
Kueue is a gate on its Pod, the gate's removal, and the Pod's deletion.

The experiments wait Pending saying why, bind when the gate lifts, and after an eviction
resume from the engine's SIGTERM checkpoint (nothing lost); every wait on "is it up" is
the poll `kubectl wait --for=condition=Ready` does.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from loraplex_operator.kube import POOLS

from tests.support.harness import KUEUE_GATE, KUEUE_QUEUE_LABEL, Harness

pytestmark = pytest.mark.slow

NS = "team-a"
POOL = "pool-q"
QUEUE = "gpu-queue"
STEPS = 10_000  # far more than the test waits for: the eviction lands mid-run


@pytest.fixture
async def h(tmp_path: Path, tiny_model_dir: Path):
    harness = Harness.create(tmp_path, tiny_model_dir)
    if harness.real_cluster:
        pytest.skip("needs the harness's gate-holding kubelet (a real cluster needs Kueue)")
    async with harness:
        yield harness


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or () if c["type"] == type_), {})


async def _wait_condition(
    h: Harness, name: str, type_: str, status: str = "True", timeout: float = 180.0
) -> dict[str, Any]:
    """`kubectl wait --for=condition=<type>` on a LoRAExperiment: poll until it holds for
    the object's current generation."""

    async def holds() -> dict[str, Any] | None:
        obj = await h.get(NS, name) or {}
        cond = _condition(obj.get("status") or {}, type_)
        current = cond.get("observedGeneration") == obj.get("metadata", {}).get("generation")
        return obj["status"] if cond.get("status") == status and current else None

    return await h.wait_for(f"{name} condition {type_}={status}", holds, timeout)


async def _pool_status(h: Harness) -> dict[str, Any]:
    assert h.kube is not None
    return (await h.kube.get(POOLS, POOL) or {}).get("status") or {}


async def _pool_condition(h: Harness, type_: str, reason: str) -> dict[str, Any]:
    async def holds() -> dict[str, Any] | None:
        cond = _condition(await _pool_status(h), type_)
        return cond if cond.get("reason") == reason else None

    return await h.wait_for(f"pool {type_} reason {reason}", holds, timeout=60)


async def _one_gated_pod(h: Harness, not_named: str = "") -> dict[str, Any]:
    async def gated() -> dict[str, Any] | None:
        pods = [p for p in await h.engine_pods(POOL) if p["metadata"]["name"] != not_named]
        if len(pods) == 1 and KUEUE_GATE in (pods[0]["spec"].get("schedulingGates") or []):
            return pods[0]
        return None

    return await h.wait_for("one gated engine pod", gated, timeout=60)


async def _both_wait_for_admission(h: Harness) -> None:
    async def waiting() -> bool:
        for name in ("q1", "q2"):
            s = await h.status(NS, name)
            reason = _condition(s, "Scheduled").get("reason")
            if s.get("phase") != "Pending" or reason != "WaitingForAdmission":
                return False
        return True

    await h.wait_for("both Pending, WaitingForAdmission", waiting, timeout=120)


async def test_gated_engines_hold_experiments_pending_and_eviction_loses_nothing(
    h: Harness,
) -> None:
    pool = h.pool_obj(POOL, slots=4, replicas=(0, 2))
    pool["spec"]["queueName"] = QUEUE
    await h.apply(pool)
    for name in ("q1", "q2"):
        await h.apply(h.experiment_obj(name, POOL, max_steps=STEPS, every=STEPS))

    # Kueue has not admitted the engine: no node, no engine, nothing bound.
    first = await _one_gated_pod(h)
    assert first["metadata"]["labels"][KUEUE_QUEUE_LABEL] == QUEUE
    await _both_wait_for_admission(h)
    s = await h.status(NS, "q1")
    assert _condition(s, "Ready")["status"] == "False"
    assert _condition(s, "Reconciling")["status"] == "True"
    assert _condition(s, "Stalled")["status"] == "False"
    assert s.get("engine") is None
    pending = await _pool_condition(h, "CapacityPending", "WaitingForAdmission")
    assert first["metadata"]["name"] in pending["message"]
    assert _condition(await _pool_status(h), "Ready")["status"] == "False"
    # No scale-up storm: four more rounds (LORAPLEX_RECONCILE_INTERVAL is 1 s here) ask
    # for nothing more while the one Pod waits.
    await asyncio.sleep(4)
    assert [p["metadata"]["name"] for p in await h.engine_pods(POOL)] == [first["metadata"]["name"]]

    # Kueue admits it: the gate lifts, the engine starts, both bind and train.
    await h.release_gate(first["metadata"]["name"])
    for name in ("q1", "q2"):
        s = await _wait_condition(h, name, "Ready")
        assert s["phase"] == "Running" and s["engine"] == first["metadata"]["name"]
    await _pool_condition(h, "Ready", "EnginesReady")
    assert _condition(await _pool_status(h), "CapacityPending")["status"] == "False"

    async def trained() -> dict[str, Any] | None:
        s = await h.status(NS, "q1")
        return s if s.get("step", 0) >= 3 else None

    seen = (await h.wait_for("q1 a few steps in", trained))["step"]

    # Kueue preempts the engine: it deletes the Pod. The engine checkpoints on SIGTERM;
    # the replacement Pod is gated again, and the experiments wait for it, not lost.
    await h.stop_engine(first["metadata"]["name"])
    second = await _one_gated_pod(h, not_named=first["metadata"]["name"])
    await _both_wait_for_admission(h)
    for name in ("q1", "q2"):
        s = await h.status(NS, name)
        assert s["restarts"] == 1 and s.get("engine") is None, s

    await h.release_gate(second["metadata"]["name"])
    for name in ("q1", "q2"):
        s = await _wait_condition(h, name, "Ready")
        assert s["engine"] == second["metadata"]["name"] and s["restarts"] == 1
    # The engine wrote its SIGTERM checkpoint after the last status the operator saw; the
    # bind names the run (the object's uid) and the new engine resumes its newest one.
    resumed = (await h.status(NS, "q1"))["checkpoint"]["step"]
    assert resumed >= seen, (seen, resumed)  # resumed where the evicted engine stopped

    async def bound_event() -> bool:  # kopf posts Events asynchronously
        events = await h.events(NS, "q1")
        return any(f"resumed from step {resumed}" in e.get("message", "") for e in events)

    await h.wait_for(f"a Bound event resumed from step {resumed}", bound_event, timeout=30)
