"""The engine's trackers, as ``serve``'s settings configure them: built at start-up (a
tracker whose client is not installed is a usage error then, not a surprise later), fed
every tick's report by the engine loop, closed at shutdown, and watched through the
``loraplex_engine_tracking_*`` series (docs/metrics.md).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from loraplex_engine.settings.tracking import TrackingSettings
from loraplex_engine.spec.api_types import TickReport
from loraplex_engine.spec.errors import UsageError
from loraplex_engine.tracking.records import records_of
from loraplex_engine.tracking.sink import Sink, Tracker

log = logging.getLogger("loraplex_engine.tracking")

CLOSE_TIMEOUT_S = 20.0
# The tracker names, as the series label them.
TRACKERS = ("mlflow", "wandb", "tensorboard")


class TrackingMetrics:
    """The sinks' events as Prometheus series (every tracker configured starts at 0)."""

    def __init__(self, registry: CollectorRegistry, trackers: list[str]) -> None:
        r, label = registry, ["tracker"]
        self.records = Counter(
            "loraplex_engine_tracking_records", "Step records a tracker took.", label, registry=r
        )
        self.drops = Counter(
            "loraplex_engine_tracking_dropped",
            "Step records dropped, oldest first, while a tracker was too slow or down.",
            label,
            registry=r,
        )
        self.errors = Counter(
            "loraplex_engine_tracking_errors", "Failed calls to a tracker.", label, registry=r
        )
        self.healthy = Gauge(
            "loraplex_engine_tracking_up",
            "1 while a tracker's last call succeeded (or none was made yet), 0 after a failure.",
            label,
            registry=r,
        )
        self.queued = Gauge(
            "loraplex_engine_tracking_queued", "Step records waiting for a tracker.", label,
            registry=r,
        )  # fmt: skip
        for name in trackers:
            for series in (self.records, self.drops, self.errors):
                series.labels(name)
            self.healthy.labels(name).set(1)

    def sent(self, tracker: str, n: int) -> None:
        self.records.labels(tracker).inc(n)

    def dropped(self, tracker: str, n: int) -> None:
        self.drops.labels(tracker).inc(n)

    def failed(self, tracker: str) -> None:
        self.errors.labels(tracker).inc()

    def up(self, tracker: str, ok: bool) -> None:
        self.healthy.labels(tracker).set(1 if ok else 0)


class Tracking:
    """Every configured tracker behind its own sink; :meth:`observe_tick` never blocks
    and never raises."""

    def __init__(
        self,
        trackers: list[Tracker],
        registry: CollectorRegistry,
        capacity: int,
        pool: str,
        clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
    ) -> None:
        self.metrics = TrackingMetrics(registry, [t.name for t in trackers])
        self.sinks = [Sink(t, self.metrics, capacity) for t in trackers]
        self.pool = pool
        self.clock_ms = clock_ms

    def observe_tick(self, report: TickReport) -> None:
        if not self.sinks:
            return
        try:
            records = records_of(report, self.pool, self.clock_ms())
            for sink in self.sinks:
                sink.put(records)
                self.metrics.queued.labels(sink.tracker.name).set(sink.queued)
        except Exception:  # tracking must never stop training
            log.exception("tracking: could not queue the tick's step records")

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Flush and close every tracker, each within ``timeout`` seconds."""
        for sink in self.sinks:
            sink.close(timeout)


class TickObservers:
    """The engine loop's observer: the tick's Prometheus series, then the trackers."""

    def __init__(self, metrics: Any, tracking: Tracking) -> None:
        self.metrics = metrics
        self.tracking = tracking

    def observe_tick(self, report: TickReport) -> None:
        try:
            self.metrics.observe_tick(report)
        finally:
            self.tracking.observe_tick(report)


def build_trackers(settings: TrackingSettings, checkpoint_root: str) -> list[Tracker]:
    """The trackers ``settings`` name; a UsageError naming the flag when one's client
    package is missing from this image."""
    trackers: list[Tracker] = []
    if settings.tracking_mlflow_uri:
        module = _client("mlflow_tracker", "--tracking-mlflow-uri", "mlflow-skinny")
        trackers.append(
            module.MlflowTracker(settings.tracking_mlflow_uri, settings.tracking_mlflow_experiment)
        )
    if settings.tracking_wandb != "off":
        module = _client("wandb_tracker", "--tracking-wandb", "wandb")
        directory = settings.tracking_wandb_dir or str(Path(checkpoint_root) / "wandb")
        trackers.append(
            module.WandbTracker(
                settings.tracking_wandb,
                settings.tracking_wandb_project,
                settings.tracking_wandb_entity,
                directory,
            )
        )
    if settings.tracking_tensorboard_dir:
        module = _client("tensorboard_tracker", "--tracking-tensorboard-dir", "tensorboard")
        trackers.append(module.TensorBoardTracker(settings.tracking_tensorboard_dir))
    return trackers


def _client(module: str, flag: str, package: str) -> Any:
    """tracking/<module>.py, which imports its tracker's client package."""
    import importlib

    try:
        return importlib.import_module(f"loraplex_engine.tracking.{module}")
    except ImportError as e:
        raise UsageError(
            f"{flag}: this engine image lacks the {package} package ({e}); use an image "
            f"with it, or leave {flag} out"
        ) from None


def start_tracking(settings: Any, registry: CollectorRegistry) -> Tracking:
    """``serve``'s trackers (none configured: a Tracking that does nothing)."""
    trackers = build_trackers(settings, settings.checkpoint_root)
    if trackers:
        log.info("tracking to %s", ", ".join(t.name for t in trackers))
    pool = os.environ.get("LORAPLEX_POOL", "")
    return Tracking(trackers, registry, settings.tracking_queue, pool)
