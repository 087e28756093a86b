"""Operator metrics (docs/metrics.md) and the HTTP server for `/metrics` and `/healthz`.

One port (8080 by default) serves both: `/metrics` in the Prometheus text format from
the operator's own registry, `/healthz` = kopf's liveness probe (kopf serves it on a
loopback port; we forward) and, on top, every pool reconciler must have finished a
round recently, so a wedged reconciler restarts the pod too.

No `_created` series (prometheus-client's process-wide switch, as in the engine):
Prometheus ignores them and they double every counter's and histogram's series.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from loraplex_operator.status import EXPERIMENT_PHASES
from loraplex_operator.versions import MOVE_KINDS

disable_created_metrics()
REGISTRY = CollectorRegistry(auto_describe=True)

EXPERIMENTS_BY_PHASE = Gauge(
    "loraplex_experiments", "Experiments by phase.", ["pool", "phase"], registry=REGISTRY
)
PLACEMENTS = Counter(
    "loraplex_placements", "Experiments bound to an engine.", ["pool"], registry=REGISTRY
)
PREEMPTIONS = Counter(
    "loraplex_preemptions",
    "Experiments checkpointed back to pending for a higher priority.",
    ["pool"],
    registry=REGISTRY,
)
RECOVERIES = Counter(
    "loraplex_recoveries",
    "Experiments moved after their engine died.",
    ["pool"],
    registry=REGISTRY,
)
SCHEDULING_LATENCY = Histogram(
    "loraplex_scheduling_latency_seconds",
    "Pending to Running (bound) latency.",
    ["pool"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
    registry=REGISTRY,
)
POOL_ENGINES = Gauge("loraplex_pool_engines", "Engine pods.", ["pool"], registry=REGISTRY)
POOL_SLOTS = Gauge("loraplex_pool_slots", "Adapter slots.", ["pool", "state"], registry=REGISTRY)
POOL_STALLED = Gauge(
    "loraplex_pool_stalled",
    "1 while the pool's Stalled condition is True; its reason (a container failure, a "
    "missing token Secret) as a label.",
    ["pool", "reason"],
    registry=REGISTRY,
)
_stalled: dict[str, str] = {}  # pool -> the reason exported, so a new reason replaces it
RECONCILE_ERRORS = Counter(
    "loraplex_reconcile_errors", "Handler errors.", ["kind"], registry=REGISTRY
)

# Per experiment (namespace, experiment = the engine's id <namespace>.<name>, so they join
# the engine's per-experiment series on (namespace, experiment)). Set from the status each
# round derives, removed when the experiment is deleted or its pool goes.
_PER_EXP = ["namespace", "experiment", "pool"]
EXPERIMENT_PHASE = Gauge(
    "loraplex_experiment_phase",
    "1 for the experiment's current phase and its reason (one series per experiment).",
    [*_PER_EXP, "phase", "reason"],
    registry=REGISTRY,
)
EXPERIMENT_RESTARTS = Gauge(
    "loraplex_experiment_restarts",
    "Times the experiment was resumed elsewhere after its engine was lost (status.restarts).",
    _PER_EXP,
    registry=REGISTRY,
)
EXPERIMENT_STEP = Gauge(
    "loraplex_experiment_step",
    "Optimiser steps the experiment has done (status.step, as of the latest round).",
    _PER_EXP,
    registry=REGISTRY,
)
EXPERIMENT_MAX_STEPS = Gauge(
    "loraplex_experiment_max_steps",
    "spec.algorithm.maxSteps (0 = continual).",
    _PER_EXP,
    registry=REGISTRY,
)
EXPERIMENT_STABLE_VERSION = Gauge(
    "loraplex_experiment_stable_version",
    "The version the experiment's stable alias points at (N of vN; docs/versions.md); no "
    "series while it has none.",
    _PER_EXP,
    registry=REGISTRY,
)
ALIAS_MOVES = Counter(
    "loraplex_alias_moves",
    "Alias moves of published versions, by kind: publish (latest), promotion and rollback "
    "(stable forward, back), alias (any other set, moved or removed).",
    ["pool", "kind"],
    registry=REGISTRY,
)

# The `kind` values the handlers, the reconciler and the publisher count errors under;
# exported at 0 from the start so dashboards and rate() show 0, not "no data", before
# the first error.
RECONCILE_ERROR_KINDS = ("pool", "experiment", "delete", "status", "unload", "pod")
for _kind in RECONCILE_ERROR_KINDS:
    RECONCILE_ERRORS.labels(kind=_kind)


def exported_names() -> set[str]:
    """Sample names this registry exports (what dashboards and alerts may use)."""
    names: set[str] = set()
    for metric in REGISTRY.collect():
        if metric.type == "counter":
            names.add(f"{metric.name}_total")
        elif metric.type == "histogram":
            names.update(f"{metric.name}{s}" for s in ("_bucket", "_count", "_sum"))
            names.add(metric.name)
        else:
            names.add(metric.name)
    return names


def set_pool(
    pool: str,
    phases: dict[str, int],
    engines: int,
    used: int,
    free: int,
    stalled: str | None = None,
) -> None:
    # The pool's event counters and latency histogram exist at 0 from its first round, so
    # rate()/increase() see the first placement (and preemptions/recoveries show 0, not
    # "no data"). labels() creates a child once and returns the existing one after.
    for counter in (PLACEMENTS, PREEMPTIONS, RECOVERIES, SCHEDULING_LATENCY):
        counter.labels(pool=pool)
    for kind in MOVE_KINDS:
        ALIAS_MOVES.labels(pool=pool, kind=kind)
    for phase in EXPERIMENT_PHASES:
        EXPERIMENTS_BY_PHASE.labels(pool=pool, phase=phase).set(phases.get(phase, 0))
    POOL_ENGINES.labels(pool=pool).set(engines)
    POOL_SLOTS.labels(pool=pool, state="used").set(used)
    POOL_SLOTS.labels(pool=pool, state="free").set(free)
    set_stalled(pool, stalled)


def set_stalled(pool: str, reason: str | None) -> None:
    """One series per stalled pool, its reason as a label; none while it is not stalled."""
    old = _stalled.pop(pool, None)
    if old is not None and old != reason:
        _remove(POOL_STALLED, pool, old)
    if reason is not None:
        POOL_STALLED.labels(pool=pool, reason=reason).set(1)
        _stalled[pool] = reason


@dataclass(frozen=True)
class ExperimentState:
    """What the per-experiment series of one experiment say."""

    namespace: str
    experiment: str  # <namespace>.<name>, the engine's `experiment` label
    phase: str
    reason: str
    restarts: int
    step: int
    max_steps: int
    stable_version: int | None = None


# pool -> (namespace, experiment) -> what was exported for it last
_exported: dict[str, dict[tuple[str, str], ExperimentState]] = {}


def set_experiments(pool: str, states: Iterable[ExperimentState]) -> None:
    """Make the pool's per-experiment series say exactly `states`.

    Level-based like the round that calls it: the same states twice change nothing; an
    experiment missing from `states` (deleted) loses all its series, and a changed
    phase or reason replaces the phase series, so there is one per experiment.
    """
    new = {(s.namespace, s.experiment): s for s in states}
    for key, old in _exported.get(pool, {}).items():
        now = new.get(key)
        if now is None:
            _remove_experiment(pool, old)
        elif (now.phase, now.reason) != (old.phase, old.reason):
            _remove(EXPERIMENT_PHASE, old.namespace, old.experiment, pool, old.phase, old.reason)
    for s in new.values():
        labels = {"namespace": s.namespace, "experiment": s.experiment, "pool": pool}
        EXPERIMENT_PHASE.labels(**labels, phase=s.phase, reason=s.reason).set(1)
        EXPERIMENT_RESTARTS.labels(**labels).set(s.restarts)
        EXPERIMENT_STEP.labels(**labels).set(s.step)
        EXPERIMENT_MAX_STEPS.labels(**labels).set(s.max_steps)
        if s.stable_version is not None:
            EXPERIMENT_STABLE_VERSION.labels(**labels).set(s.stable_version)
        else:
            _remove(EXPERIMENT_STABLE_VERSION, s.namespace, s.experiment, pool)
    if new:
        _exported[pool] = new
    else:
        _exported.pop(pool, None)


def _remove_experiment(pool: str, s: ExperimentState) -> None:
    _remove(EXPERIMENT_PHASE, s.namespace, s.experiment, pool, s.phase, s.reason)
    for gauge in (
        EXPERIMENT_RESTARTS,
        EXPERIMENT_STEP,
        EXPERIMENT_MAX_STEPS,
        EXPERIMENT_STABLE_VERSION,
    ):
        _remove(gauge, s.namespace, s.experiment, pool)


def forget_pool(pool: str) -> None:
    set_experiments(pool, ())
    for phase in EXPERIMENT_PHASES:
        _remove(EXPERIMENTS_BY_PHASE, pool, phase)
    _remove(POOL_ENGINES, pool)
    _remove(POOL_SLOTS, pool, "used")
    _remove(POOL_SLOTS, pool, "free")
    set_stalled(pool, None)
    for counter in (PLACEMENTS, PREEMPTIONS, RECOVERIES, SCHEDULING_LATENCY):
        _remove(counter, pool)
    for kind in MOVE_KINDS:
        _remove(ALIAS_MOVES, pool, kind)


def _remove(metric: Any, *labels: str) -> None:
    with contextlib.suppress(KeyError):
        metric.remove(*labels)


class Heartbeats:
    """When each pool reconciler last finished a round (monotonic seconds)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def beat(self, pool: str) -> None:
        self._last[pool] = time.monotonic()

    def forget(self, pool: str) -> None:
        self._last.pop(pool, None)

    def stale(self, max_age: float) -> list[str]:
        now = time.monotonic()
        return sorted(p for p, t in self._last.items() if now - t > max_age)


async def serve(
    port: int,
    heartbeats: Heartbeats,
    max_age: float,
    kopf_liveness: str | None,
    host: str = "0.0.0.0",
) -> Any:
    """Start the metrics/health server in the running loop; returns the aiohttp runner."""
    import aiohttp
    import aiohttp.web

    async def metrics(_: aiohttp.web.Request) -> aiohttp.web.Response:
        body = generate_latest(REGISTRY)
        return aiohttp.web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: aiohttp.web.Request) -> aiohttp.web.Response:
        report: dict[str, Any] = {}
        ok = True
        if kopf_liveness:
            try:
                timeout = aiohttp.ClientTimeout(total=5)
                async with (
                    aiohttp.ClientSession(timeout=timeout) as s,
                    s.get(kopf_liveness) as r,
                ):
                    report["kopf"] = await r.json()
                    ok = r.status == 200
            except Exception as e:  # kopf's probe server is gone: not alive
                report["kopf"] = repr(e)
                ok = False
        stale = heartbeats.stale(max_age)
        if stale:
            report["stalePools"] = stale
            ok = False
        return aiohttp.web.json_response(report, status=200 if ok else 503)

    app = aiohttp.web.Application()
    app.add_routes([aiohttp.web.get("/metrics", metrics), aiohttp.web.get("/healthz", healthz)])
    runner = aiohttp.web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, host, port).start()
    return runner
