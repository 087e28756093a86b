"""Observations for the pool's pure round planning: a clock (`NOW`), a config, engine
views, experiment objects and the snapshot that holds them, with no I/O."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from loraplex_operator.config import Config
from loraplex_operator.observation import EngineView, Snapshot
from loraplex_operator.resources import Experiment, Pool

from tests.support.builders import experiment, pool

NOW = 1_800_000_000.0
CFG = Config(scale_down_delay=30.0, max_restarts=2)


def engine(
    name: str, *running: str, slots: int = 4, ready: bool = True, **statuses: Any
) -> EngineView:
    exps = {}
    for exp_id in running:
        ns, _, n = exp_id.partition(".")
        exps[exp_id] = {"id": exp_id, "namespace": ns, "name": n, "phase": "Running", "step": 3}
        exps[exp_id].update(statuses.get(exp_id.replace(".", "_").replace("-", "_"), {}))
    return EngineView(
        name=name,
        url=f"http://{name}:8000",
        node="node-1",
        pod_ready=ready,
        reachable=ready,
        pod_phase="Running",
        capacity={"maxAdapters": slots, "maxRank": 64, "usedSlots": len(exps)},
        experiments=exps if ready else {},
    )


def exp(name: str, created: int = 0, **status: Any) -> dict[str, Any]:
    w = experiment(name).set("metadata.creationTimestamp", timestamp(NOW - 1000 + created))
    if status:
        w = w.status(**status)
    return w.obj()


def timestamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def snap(
    exps: list[dict[str, Any]], engines: list[EngineView], p: Any = None, **kw: Any
) -> Snapshot:
    p = p or pool().slots(4).replicas(0, 2).obj()
    views = [Experiment.from_obj(x) for x in exps]
    return Snapshot(pool=Pool.from_obj(p), experiments=views, engines=engines, now=NOW, **kw)
