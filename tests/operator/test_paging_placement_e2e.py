"""Placement by registered adapters, end to end: the real operator (kopf) against kmock and
real engine processes on the tiny model. An engine that pages (`maxRegistered` above its
slots) takes more experiments than it has slots; one that does not is packed by slots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from loraplex_operator.kube import POOLS

from tests.support.harness import Harness

pytestmark = pytest.mark.slow

NS = "team-a"


@pytest.fixture
async def h(tmp_path: Path, tiny_model_dir: Path):
    async with Harness.create(tmp_path, tiny_model_dir) as harness:
        yield harness


async def _pool_status(h: Harness, pool: str) -> dict[str, Any]:
    assert h.kube is not None
    return (await h.kube.get(POOLS, pool) or {}).get("status") or {}


async def _all_bound(h: Harness, names: list[str]) -> dict[str, str] | None:
    """name -> engine once every experiment is bound (Scheduled or Running) at once."""
    statuses = {n: await h.status(NS, n) for n in names}
    bound = {
        n: s["engine"]
        for n, s in statuses.items()
        if s.get("phase") in ("Scheduled", "Running") and s.get("engine")
    }
    return bound if len(bound) == len(names) else None


async def _run_all(h: Harness, pool: str, names: list[str], steps: int) -> None:
    for i, name in enumerate(names):
        await h.apply(h.experiment_obj(name, pool, max_steps=steps, every=steps, seed=i))


async def test_a_paging_engine_takes_more_experiments_than_slots(h: Harness) -> None:
    # Two slots, six registered: five experiments on the one engine the pool may have.
    await h.apply(h.pool_obj("pool-p", slots=2, replicas=(0, 1), max_registered=6))
    names = [f"paged{i}" for i in range(5)]
    await _run_all(h, "pool-p", names, steps=400)

    bound = await h.wait_for("five bound at once", lambda: _all_bound(h, names), timeout=300)
    assert len(set(bound.values())) == 1, bound
    pod = next(iter(bound.values()))
    assert pod.startswith("pool-p-engine-")
    assert [p["metadata"]["name"] for p in await h.engine_pods("pool-p")] == [pod]

    async def counted() -> dict[str, Any] | None:
        s = await _pool_status(h, "pool-p")
        return s if s.get("registeredUsed") == 5 else None

    status = await h.wait_for("pool status counts 5 registered", counted, timeout=120)
    assert status["registeredFree"] == 1
    assert status["slotsUsed"] <= 2  # the others are paged out, not in slots
    assert status["pagedAdapters"] >= 3

    async def stepped() -> bool:  # more experiments than slots all train: paging rotates
        steps = [(await h.status(NS, n)).get("step", 0) for n in names]
        return all(step >= 1 for step in steps)

    await h.wait_for("every experiment steps", stepped, timeout=300)


async def test_an_engine_that_does_not_page_is_packed_by_slots(h: Harness) -> None:
    # maxRegistered = maxAdapters: the engine registers no more than its slots.
    await h.apply(h.pool_obj("pool-s", slots=2, replicas=(0, 2), max_registered=2))
    names = [f"slotted{i}" for i in range(4)]
    await _run_all(h, "pool-s", names, steps=400)

    bound = await h.wait_for("four bound at once", lambda: _all_bound(h, names), timeout=300)
    per_engine = sorted(list(bound.values()).count(e) for e in set(bound.values()))
    assert per_engine == [2, 2], bound
    status = await _pool_status(h, "pool-s")
    assert status.get("pagedAdapters", 0) == 0
