"""Who sees which of the engine's series on ``/metrics``.

Per-experiment and per-model series carry tenants' names (``namespace``, ``experiment``:
a client experiment's or a Tinker model's id among them), and a co-tenant that learns
another's model id could try to claim it. So with auth configured, ``/metrics`` answers
every series only to a caller with the engine's bearer token (the chart's PodMonitor
scrapes with it); anyone else (the port is shared with tenants holding Tinker keys) gets
the engine's own series alone, every sample carrying a tenant label left out. Without
auth (``--insecure-no-auth``) everything is open anyway.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

# Labels whose values name a tenant or what it owns.
TENANT_LABELS = frozenset({"namespace", "experiment", "model", "model_id"})


def sees_tenants(authorization: str | None, token: str | None) -> bool:
    """Whether a request with this ``Authorization`` header may read tenants' series."""
    if token is None:
        return True
    given = (authorization or "").strip()
    if given[:7].lower() == "bearer ":
        given = "Bearer " + given[7:].strip()
    return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())


class _TenantFree:
    def __init__(self, registry: Collector) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():
            kept = [s for s in family.samples if not TENANT_LABELS & s.labels.keys()]
            if not kept and family.samples:
                continue
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = kept
            yield out


def tenant_free(registry: Collector) -> bytes:
    """The registry's exposition without any sample that carries a tenant label."""
    return generate_latest(_TenantFree(registry))  # type: ignore[arg-type]
