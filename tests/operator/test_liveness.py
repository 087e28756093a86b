"""The chart's livenessProbe asks kopf's own health endpoint: a wedged reconciler must
fail it. Runs kopf's real health reporter with the handlers the chart's module registers."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import httpx
import kopf
import loraplex_operator.handlers  # noqa: F401  (registers the probe)
from kopf._core.engines.indexing import OperatorIndexers
from kopf._core.engines.probing import health_reporter
from kopf._core.intents.registries import OperatorRegistry
from loraplex_operator import metrics as m


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_kopf_liveness_fails_while_a_pool_reconciler_is_stale() -> None:
    heartbeats = m.Heartbeats()
    heartbeats.beat("pool-a")
    memo = kopf.Memo(
        reconciler=SimpleNamespace(heartbeats=heartbeats), config=SimpleNamespace(interval=5.0)
    )
    registry: OperatorRegistry = kopf.get_default_registry()
    settings = kopf.OperatorSettings()
    url = f"http://127.0.0.1:{_free_port()}/healthz"
    ready = asyncio.Event()
    task = asyncio.create_task(
        health_reporter(
            url,
            memo=memo,
            indices=OperatorIndexers().indices,
            registry=registry,
            settings=settings,
            ready_flag=ready,
        )
    )
    try:
        await asyncio.wait_for(ready.wait(), 10)
        async with httpx.AsyncClient(timeout=10) as c:
            assert (await c.get(url)).status_code == 200
            heartbeats._last["pool-a"] -= 3600  # the pool's rounds stopped finishing
            await asyncio.sleep(10.1)  # kopf caches probe results for 10 s
            assert (await c.get(url)).status_code == 500
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
