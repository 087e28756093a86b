"""An engine pod is one unit: when a rank of a multi-rank engine dies, the whole engine
exits non-zero, the kubelet restarts its container in the same Pod (restartPolicy
Always), and the operator treats that as any lost engine: the experiment is bound again,
to the restarted engine, from its last checkpoint, and succeeds with every step trained.

Through the deployed-operator harness: the operator as the chart renders it, the engine
Pod's own command line (with `--world-size 2`, gloo ranks on the CPU) run by the test
kubelet, which restarts containers as a kubelet does (kubelet.py). The one-rank case is
the same recovery for an engine that crashes on its own.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest
from loraplex_operator.kube import PODS

from tests.support.harness import ENGINE_NS, Harness

pytestmark = pytest.mark.slow

NS, POOL, EXP = "team-a", "pool-ranks", "resume"
# Long enough that the kill lands mid-run, checkpoints sparse enough that the resume has
# steps to redo (LORAPLEX_E2E_STEPS scales it, as in test_operator_e2e).
STEPS = int(os.environ.get("LORAPLEX_E2E_STEPS", "200"))
EVERY = max(STEPS // 15, 2)


@pytest.fixture
async def h(tmp_path: Path, tiny_model_dir: Path):
    async with Harness(tmp_path, tiny_model_dir) as harness:
        yield harness


def _rank_process(main: psutil.Process, rank: int) -> psutil.Process:
    """The process of `rank` in the engine's container: rank 0 is the main process, the
    others its children (the engine's launcher sets RANK in their environment)."""
    if rank == 0:
        return main
    for child in main.children(recursive=True):  # a rank before its own children
        with contextlib.suppress(psutil.Error):  # a short-lived child may be gone already
            if child.environ().get("RANK") == str(rank):
                return child
    raise AssertionError(f"no rank {rank} under engine process {main.pid}")


async def _restart_count(h: Harness, pod: str) -> int:
    assert h.kube is not None
    obj = await h.kube.get(PODS, pod, ENGINE_NS) or {}
    statuses = obj.get("status", {}).get("containerStatuses") or [{}]
    return int(statuses[0].get("restartCount", 0))


async def _messages(h: Harness, reason: str) -> list[str]:
    return [e.get("message", "") for e in await h.events(NS, EXP) if e.get("reason") == reason]


@pytest.mark.parametrize(("gpus", "killed_rank"), [(2, 1), (1, 0)], ids=["rank-1-of-2", "alone"])
async def test_a_dead_rank_restarts_the_pod_and_the_experiment_resumes_losing_no_step(
    h: Harness, gpus: int, killed_rank: int
) -> None:
    pool: dict[str, Any] = h.pool_obj(POOL, slots=2, replicas=(1, 1))
    pool["spec"]["gpusPerEngine"] = gpus
    await h.apply(pool)
    await h.apply(h.experiment_obj(EXP, POOL, max_steps=STEPS, every=EVERY))

    async def checkpointed() -> dict[str, Any] | None:
        s = await h.status(NS, EXP)
        running = s.get("phase") == "Running" and (s.get("checkpoint") or {}).get("step")
        return s if running else None

    before = await h.wait_for("a checkpoint while running", checkpointed, timeout=240)
    pod = before["engine"]
    assert h.kubelet is not None
    engine = h.kubelet.processes[pod]
    assert engine.argv.count("--world-size") == (gpus > 1)
    main = psutil.Process(engine.proc.pid)  # type: ignore[union-attr]
    _rank_process(main, killed_rank).send_signal(signal.SIGKILL)
    killed_at = (await h.status(NS, EXP))["checkpoint"]["step"]  # the newest it can resume

    async def restarted() -> bool:
        return await _restart_count(h, pod) == 1

    await h.wait_for("the engine container restarted in its pod", restarted, timeout=120)
    done = await h.wait_phase(NS, EXP, "Succeeded", timeout=300)
    assert done["step"] == STEPS and done["checkpoint"]["step"] == STEPS
    assert done["restarts"] == 1 and done["engine"] == pod  # the same Pod, restarted
    assert [p["metadata"]["name"] for p in await h.engine_pods(POOL)] == [pod]
    lost = await _messages(h, "EngineLost")
    assert len(lost) == 1 and pod in lost[0], lost
    resumed = [m for m in await _messages(h, "Bound") if "resumed from step" in m]
    assert len(resumed) == 1, resumed
    step = int(re.search(r"resumed from step (\d+)", resumed[0]).group(1))  # type: ignore[union-attr]
    assert step >= killed_at, (step, killed_at)  # from its newest checkpoint: nothing lost
    assert step % EVERY == 0 and step < STEPS
    if gpus > 1:  # the restarted container runs both ranks again
        fresh = psutil.Process(h.kubelet.processes[pod].proc.pid)  # type: ignore[union-attr]
        assert _rank_process(fresh, 1).is_running()
