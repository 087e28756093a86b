"""The gateway's own metrics (docs/metrics.md), on its own registry, served at /metrics.

Per namespace and API (``openai`` or ``tinker``): requests by status code, latency to the
end of the answer, time to the first streamed byte (TTFT), and engines lost mid-answer.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

# No `_created` twin per series (promtool check metrics; issue 33), as the engine and operator.
disable_created_metrics()

REGISTRY = CollectorRegistry(auto_describe=True)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

REQUESTS = Counter(
    "loraplex_gateway_requests",
    "Requests answered, by namespace (empty: no key), API and HTTP status code.",
    ["namespace", "api", "code"],
    registry=REGISTRY,
)
LATENCY = Histogram(
    "loraplex_gateway_request_seconds",
    "Request latency through the gateway, to the answer's last byte.",
    ["namespace", "api"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
TTFT = Histogram(
    "loraplex_gateway_time_to_first_token_seconds",
    "Streamed answers: request to the first streamed chunk.",
    ["namespace"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
UPSTREAM_REASONS = ("connect", "reset", "timeout")  # upstream.transport_reason's answers
UPSTREAM_ERRORS = Counter(
    "loraplex_gateway_upstream_errors",
    "Engine calls that failed in transport (connect, reset, timeout), by reason.",
    ["reason"],
    registry=REGISTRY,
)
for _reason in UPSTREAM_REASONS:  # at 0 from the start: the dashboard shows 0, not no data
    UPSTREAM_ERRORS.labels(_reason)
ENGINES = Gauge("loraplex_gateway_engines", "Engines the gateway routes to.", registry=REGISTRY)
KEYS = Gauge("loraplex_gateway_api_keys", "API keys loaded.", registry=REGISTRY)
