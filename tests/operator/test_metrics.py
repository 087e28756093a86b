"""Operator metrics: names match docs/metrics.md; /metrics and /healthz answer."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import httpx
from loraplex_operator import metrics as m

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def _doc_names() -> set[str]:
    text = DOC.read_text()
    operator = text.split("## Operator", 1)[1]
    return set(re.findall(r"^\| `(loraplex_[a-z_]+)` \|", operator, flags=re.M))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_registered_names_are_the_documented_ones() -> None:
    documented = _doc_names()
    assert documented, "no operator metrics table in docs/metrics.md"
    exported = m.exported_names()
    assert documented <= exported, documented - exported
    base = {n for n in exported if not n.endswith(("_bucket", "_count", "_sum"))}
    assert base == documented, base ^ documented


async def test_metrics_and_healthz_served_on_one_port() -> None:
    hb = m.Heartbeats()
    hb.beat("pool-x")
    m.set_pool("pool-x", {"Running": 2}, engines=1, used=2, free=2)
    port = _free_port()
    runner = await m.serve(port, hb, max_age=60.0, kopf_liveness=None, host="127.0.0.1")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
            text = (await c.get("/metrics")).text
            assert 'loraplex_experiments{phase="Running",pool="pool-x"} 2.0' in text
            assert 'loraplex_pool_slots{pool="pool-x",state="free"} 2.0' in text
            assert (await c.get("/healthz")).status_code == 200
            hb._last["pool-x"] -= 3600  # a reconciler that stopped finishing rounds
            r = await c.get("/healthz")
            assert r.status_code == 503 and r.json()["stalePools"] == ["pool-x"]
    finally:
        await runner.cleanup()
        m.forget_pool("pool-x")
