"""Engine pod failures, as a kubelet and the scheduler produce them, explained by the real
operator (the chart's, against kmock; the test kubelet of kubelet.py writes the pod
states a kubelet writes, kubelet_status.py).

One operator and six pools, each broken one way, each with one experiment waiting:

- crash: baseModel is a path the image lacks; the engine exits and is restarted with
  the crash back-off: CrashLoopBackOff (its log's tail in the message);
- image: an image the registry lacks: ErrImagePull, then ImagePullBackOff;
- config: an env var from a Secret that does not exist: CreateContainerConfigError;
- oom: a memory limit below what the engine needs: SIGKILLed over it, restarted: OOMKilled;
- nonode: a nodeSelector no node matches: PodScheduled=False, Unschedulable, which
  stalls after LORAPLEX_STALL_AFTER (the chart's engines.stallAfterSeconds, 2 s here);
- gpu: a GPU whose device plugin reports it unhealthy: the kubelet fails the pod,
  UnexpectedAdmissionError;
- hung: a healthy engine (replicas.min 1) that stops answering (SIGSTOP): the kubelet's
  readiness probe fails, the Pod stays Running, not Ready: ReadinessProbeFailing after
  LORAPLEX_STALL_AFTER.

Each becomes the pool's `Stalled` reason with the container's message, a Warning Event
on the pool naming it, and the waiting experiment's `Scheduled` reason. The last is the
only one whose pods fail (the others are restarted in place by the kubelet, so one pod
each, never replaced): its replacements back off (at once, then 10 s, 20 s, ...), counted
over a window.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from loraplex_operator.kube import POOLS, Resource

from tests.support.harness import Harness

pytestmark = pytest.mark.slow

IMAGE = "loraplex/engine-cpu:test"
NS = "team-a"
# pool -> (what breaks it, the Stalled reasons it may show, text its message contains)
BROKEN: dict[str, tuple[dict[str, Any], set[str], str]] = {
    "crash": (  # the engine's own error, from its log's tail
        {"spec.baseModel": "/models/missing"},
        {"CrashLoopBackOff"},
        "model directory /models/missing does not exist",
    ),
    "image": (
        {"spec.template.image": "loraplex/engine-cpu:missing"},
        {"ErrImagePull", "ImagePullBackOff"},
        "loraplex/engine-cpu:missing",
    ),
    "config": (
        {
            "spec.template.env": [
                {"name": "OMP_NUM_THREADS", "value": "1"},
                {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}},
            ]
        },
        {"CreateContainerConfigError"},
        'secret "hf" not found',
    ),
    "oom": (
        {"spec.template.resources": {"limits": {"memory": "64Mi"}}},
        {"OOMKilled"},
        "exit code 137 (OOMKilled)",
    ),
    "nonode": (
        {"spec.template.nodeSelector": {"gpu.example.com/model": "h200"}},
        {"Unschedulable"},
        "didn't match Pod's node affinity/selector",
    ),
    "gpu": (
        {"spec.template.resources": {"limits": {"nvidia.com/gpu": 1}}},
        {"UnexpectedAdmissionError"},
        "no healthy devices present",
    ),
}
WINDOW_S = 40.0


def _set(obj: dict[str, Any], path: str, value: Any) -> None:
    *head, last = path.split(".")
    for part in head:
        obj = obj.setdefault(part, {})
    obj[last] = value


@pytest.fixture
async def h(tmp_path: Path, tiny_model_dir: Path):
    # The chart's engines.stallAfterSeconds, as a user sets it (LORAPLEX_STALL_AFTER).
    harness = Harness(tmp_path, tiny_model_dir, chart_values={"engines": {"stallAfterSeconds": 2}})
    harness.operator_env["LORAPLEX_ENGINE_TIMEOUT"] = "3"  # the hung engine's probes
    async with harness:
        assert harness.kubelet is not None
        harness.kubelet.node.images = {IMAGE}
        harness.kubelet.node.unhealthy = {"nvidia.com/gpu"}
        harness.kubelet.probe_readiness = True
        yield harness


async def _stalled(h: Harness, pool: str) -> dict[str, Any] | None:
    assert h.kube is not None
    obj = await h.kube.get(POOLS, pool) or {}
    conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or ()}
    stalled = conds.get("Stalled") or {}
    return stalled if stalled.get("status") == "True" else None


async def _pool_events(h: Harness, pool: str) -> list[dict[str, Any]]:
    assert h.kube is not None
    events = await h.kube.list(Resource("", "v1", "events"))
    return [e for e in events if (e.get("involvedObject") or {}).get("name") == pool]


async def test_each_engine_failure_stalls_its_pool_with_reason_event_and_backoff(
    h: Harness,
) -> None:
    t0 = time.monotonic()
    for name, (changes, _, _) in BROKEN.items():
        pool = h.pool_obj(name, replicas=(0, 1))
        for path, value in changes.items():
            _set(pool, path, value)
        await h.apply(pool)
        await h.apply(h.experiment_obj(f"on-{name}", name))

    await h.apply(h.pool_obj("hung", replicas=(1, 1)))

    async def hung_engine() -> Any:
        return [
            p for p in await h.engine_pods("hung") if p["metadata"]["name"] in kubelet.processes
        ]

    kubelet = h.kubelet
    assert kubelet is not None
    (hung, *_) = await h.wait_for("the hung pool's engine up", hung_engine, timeout=180)
    engine = kubelet.processes[hung["metadata"]["name"]].proc
    assert engine is not None
    os.killpg(engine.pid, signal.SIGSTOP)  # it stops answering, as a wedged engine does

    async def all_stalled() -> bool:
        return all([await _stalled(h, name) for name in [*BROKEN, "hung"]])

    try:
        await h.wait_for("every pool Stalled", all_stalled, timeout=180)
        stalled = await _stalled(h, "hung")
        assert stalled is not None and stalled["reason"] == "ReadinessProbeFailing", stalled
        assert "running but not ready" in stalled["message"], stalled

        async def hung_warned() -> bool:
            events = await _pool_events(h, "hung")
            return any(e.get("reason") == "ReadinessProbeFailing" for e in events)

        await h.wait_for("a Warning Event on pool hung", hung_warned)
    finally:
        os.killpg(engine.pid, signal.SIGCONT)
    for name, (_, reasons, text) in BROKEN.items():
        stalled = await _stalled(h, name)
        assert stalled is not None and stalled["reason"] in reasons, (name, stalled)
        assert text in stalled["message"] and "engine pod" in stalled["message"], stalled

        async def warned(name: str = name, reasons: set[str] = reasons) -> list[Any]:
            return [
                e
                for e in await _pool_events(h, name)
                if e.get("type") == "Warning" and e.get("reason") in reasons
            ]

        (event, *_) = await h.wait_for(f"a Warning Event on pool {name}", warned)
        assert f"{name}-engine-" in event["message"], event

        async def says_why(name: str = name, reasons: set[str] = reasons) -> Any:
            status = await h.status(NS, f"on-{name}")
            conds = {c["type"]: c for c in status.get("conditions") or ()}
            sched = conds.get("Scheduled") or {}
            expected = {"EngineUnschedulable"} if name == "nonode" else reasons
            return sched if sched.get("reason") in expected else None

        sched = await h.wait_for(f"on-{name} says why it waits", says_why)
        assert sched["status"] == "False" and f"{name}-engine-" in sched["message"], sched

    for name in BROKEN:  # restarted in place by the kubelet, or never started: one pod
        if name != "gpu":
            assert len(await h.engine_pods(name)) == 1, name

    # Replacements of the gpu pool's failed pods back off: count their creations (from
    # the API server's record: each lives well under a second) over the window.
    await asyncio.sleep(max(WINDOW_S - (time.monotonic() - t0), 0))
    assert h.api is not None
    times = [
        t for plural, _, name, t in h.api.creations if plural == "pods" and name.startswith("gpu-")
    ]
    times = [t for t in times if t - t0 <= WINDOW_S]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    print(f"gpu pool: pods created at {[round(t - t0, 1) for t in times]} s")
    # At once, then 10 s, then 20 s: at most 4 pods in 40 s (a round is 1 s here: without
    # the back-off, one pod a round).
    assert 3 <= len(times) <= 4, (times, gaps)
    assert all(g >= 8 for g in gaps[1:]), gaps
