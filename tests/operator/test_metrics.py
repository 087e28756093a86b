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
    operator = text.split("## Operator", 1)[1].split("\n## ", 1)[0]  # its section alone
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


def _stalled_series() -> list[str]:
    from prometheus_client import generate_latest

    text = generate_latest(m.REGISTRY).decode()
    return [line for line in text.splitlines() if line.startswith("loraplex_pool_stalled{")]


def test_a_stalled_pool_has_one_series_with_its_reason_and_none_once_it_recovers() -> None:
    try:
        m.set_pool("pool-s", {}, engines=1, used=0, free=0, stalled="ImagePullBackOff")
        assert _stalled_series() == [
            'loraplex_pool_stalled{pool="pool-s",reason="ImagePullBackOff"} 1.0'
        ]
        m.set_pool("pool-s", {}, engines=1, used=0, free=0, stalled="CrashLoopBackOff")
        assert _stalled_series() == [
            'loraplex_pool_stalled{pool="pool-s",reason="CrashLoopBackOff"} 1.0'
        ]
        m.set_pool("pool-s", {}, engines=1, used=0, free=4)
        assert _stalled_series() == []
        m.set_pool("pool-s", {}, engines=1, used=0, free=0, stalled="OOMKilled")
    finally:
        m.forget_pool("pool-s")
    assert _stalled_series() == []


# --- per-experiment series: set, change, delete ------------------------------------------

PER_EXPERIMENT = (
    "loraplex_experiment_phase",
    "loraplex_experiment_restarts",
    "loraplex_experiment_step",
    "loraplex_experiment_max_steps",
)


def _series(pool: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(name, sorted labels) -> value of every per-experiment sample of `pool`."""
    out = {}
    for family in m.REGISTRY.collect():
        for s in family.samples:
            if s.name in PER_EXPERIMENT and s.labels.get("pool") == pool:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _phases(pool: str) -> dict[str, tuple[str, str]]:
    """experiment -> (phase, reason) of its phase series (asserting there is one)."""
    out: dict[str, tuple[str, str]] = {}
    for (name, labels), value in _series(pool).items():
        if name == "loraplex_experiment_phase":
            d = dict(labels)
            assert d["experiment"] not in out, f"two phase series for {d['experiment']}"
            assert value == 1
            out[d["experiment"]] = (d["phase"], d["reason"])
    return out


def _state(name: str, phase: str, reason: str, restarts: int = 0, step: int = 0):
    return m.ExperimentState("team-a", f"team-a.{name}", phase, reason, restarts, step, 50)


def test_experiment_series_follow_set_change_and_delete() -> None:
    pool = "pool-lifecycle"
    try:
        m.set_experiments(
            pool, [_state("a", "Pending", "NoCapacity"), _state("b", "Running", "Training", step=3)]
        )
        assert _phases(pool) == {
            "team-a.a": ("Pending", "NoCapacity"),
            "team-a.b": ("Running", "Training"),
        }
        labels = {"namespace": "team-a", "experiment": "team-a.b", "pool": pool}
        assert m.REGISTRY.get_sample_value("loraplex_experiment_step", labels) == 3
        assert m.REGISTRY.get_sample_value("loraplex_experiment_max_steps", labels) == 50

        # Rounds repeat: the same states again change nothing.
        before = _series(pool)
        m.set_experiments(
            pool, [_state("a", "Pending", "NoCapacity"), _state("b", "Running", "Training", step=3)]
        )
        assert _series(pool) == before

        # a is bound and runs; b's engine is lost: it restarts, pending again.
        m.set_experiments(
            pool,
            [
                _state("a", "Running", "Training", step=1),
                _state("b", "Pending", "WaitingForEngine", restarts=1, step=3),
            ],
        )
        assert _phases(pool) == {
            "team-a.a": ("Running", "Training"),
            "team-a.b": ("Pending", "WaitingForEngine"),
        }
        assert m.REGISTRY.get_sample_value("loraplex_experiment_restarts", labels) == 1

        # b is deleted: every series of b goes, a's stay.
        m.set_experiments(pool, [_state("a", "Failed", "EngineReportedFailure", step=1)])
        assert _phases(pool) == {"team-a.a": ("Failed", "EngineReportedFailure")}
        assert not [k for k in _series(pool) if ("experiment", "team-a.b") in k[1]]
        assert len(_series(pool)) == len(PER_EXPERIMENT)

        # The last one deleted: nothing left of the pool.
        m.set_experiments(pool, [])
        assert _series(pool) == {}
    finally:
        m.forget_pool(pool)


def test_forget_pool_removes_its_experiments_only() -> None:
    try:
        m.set_experiments("pool-x1", [_state("a", "Running", "Training")])
        m.set_experiments("pool-x2", [_state("b", "Running", "Training")])
        m.forget_pool("pool-x1")
        assert _series("pool-x1") == {}
        assert _phases("pool-x2") == {"team-a.b": ("Running", "Training")}
    finally:
        m.forget_pool("pool-x1")
        m.forget_pool("pool-x2")
