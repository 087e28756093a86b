"""The Tinker protocol's per-namespace gauges on the engine's ``/metrics`` (docs/metrics.md),
read from the protocol's own tables as each scrape collects them: nothing to keep in step.

``loraplex_engine_tinker_recorded_bytes{namespace}``: the memory the samples recorded for
``stable_reinforce`` hold (server/tinker/recorded.py). Its ``namespace`` values are those
holding recordings now, each an authenticated tenant's (a key's or the gateway's), so the
label set is bounded by the tenants; a namespace whose recordings are all gone has no
series. ``namespace`` is a tenant label: only the engine's token reads it
(server/metrics_access.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.metrics_core import Metric

from loraplex_engine.server.tinker.recorded import Recorder

RECORDED_BYTES = "loraplex_engine_tinker_recorded_bytes"


class RecordedBytes(Gauge):
    """A gauge set from the recorder's table each time the registry collects it."""

    def __init__(self, *args: Any, recorder: Recorder | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._recorder = recorder  # None on the per-label children prometheus-client makes

    def collect(self) -> Iterable[Metric]:
        if self._recorder is not None:
            held = self._recorder.held_bytes_by_namespace()
            self.clear()  # namespaces holding none have no series
            for namespace, n in held.items():
                self.labels(namespace=namespace).set(n)
        return super().collect()


def export_tinker_gauges(registry: CollectorRegistry, recorder: Recorder) -> None:
    """Adds the Tinker gauges to the engine's registry."""
    RecordedBytes(
        RECORDED_BYTES,
        "Memory the samples recorded for stable_reinforce hold, per namespace.",
        ["namespace"],
        registry=registry,
        recorder=recorder,
    )
