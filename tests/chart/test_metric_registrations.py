"""Every metric name the dashboards and alert rules read is registered by the code, and
docs/metrics.md lists exactly what the engine, the operator and the gateway register
(name, type, labels).

The names come from the real prometheus-client registries: a fresh
`loraplex_engine.metrics.EngineMetrics()`, the operator's module-level
`loraplex_operator.metrics.REGISTRY` and the gateway's
`loraplex_operator.gateway.metrics.REGISTRY`. A counter `x` registers the series `x_total`, a
histogram `x_bucket`/`x_sum`/`x_count` (promql_names.exported_series_names does the same
expansion for the documented names).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.chart_helpers import DASHBOARDS, METRICS_DOC, REPO, RULES_FILE
from tests.support.promql_names import (
    SYNTHETIC,
    dashboard_names,
    documented_metrics,
    exported_series_names,
    rules_names,
)


def _collectors(registry: Any) -> list[Any]:
    # prometheus-client keeps no public list of a registry's collectors; its private map
    # is stable across 0.x and gives the metric objects (name, type, label names).
    return list(registry._collector_to_names)


def registered(registry: Any) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Documented-style name (counters with `_total`) → (type, label names)."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for metric in _collectors(registry):
        kind = metric._type
        name = metric._name + ("_total" if kind == "counter" else "")
        out[name] = (kind, tuple(metric._labelnames))
    return out


def engine_registry() -> Any:
    from loraplex_engine.metrics import EngineMetrics
    from loraplex_engine.server.tinker.gauges import export_tinker_gauges
    from loraplex_engine.server.tinker.recorded import Recorder
    from loraplex_engine.tracking.hub import TrackingMetrics

    registry = EngineMetrics().registry
    TrackingMetrics(registry, [])  # `serve` registers the tracking series beside them
    export_tinker_gauges(registry, Recorder())  # and the Tinker ones, serving /api/v1
    return registry


def operator_registry() -> Any:
    from loraplex_operator import metrics

    return metrics.REGISTRY


def gateway_registry() -> Any:
    from loraplex_operator.gateway import metrics

    return metrics.REGISTRY


def registered_series() -> set[str]:
    names: dict[str, str] = {}
    for registry in (engine_registry(), operator_registry(), gateway_registry()):
        names.update({n: kind for n, (kind, _) in registered(registry).items()})
    return exported_series_names(names)


# --- dashboards and rules vs. the registries ----------------------------------------------


def _unregistered(used: dict[str, set[str]]) -> dict[str, list[str]]:
    allowed = registered_series() | SYNTHETIC
    return {name: sorted(where) for name, where in used.items() if name not in allowed}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_names_are_registered(path: Path) -> None:
    used = dashboard_names(path)
    assert used, "no metric found: the extraction is broken"
    assert not _unregistered(used)


def test_rules_names_are_registered() -> None:
    used = rules_names(RULES_FILE)
    assert used
    assert not _unregistered(used)


def test_registered_series_expansion() -> None:
    series = registered_series()
    assert "loraplex_engine_steps_total" in series
    assert "loraplex_engine_steps" not in series
    assert "loraplex_engine_tick_seconds" not in series  # a histogram's base is no series
    assert {
        "loraplex_engine_tick_seconds_bucket",
        "loraplex_engine_tick_seconds_sum",
        "loraplex_scheduling_latency_seconds_count",
        "loraplex_placements_total",
        "loraplex_pool_slots",
    } <= series


# --- docs/metrics.md vs. the registries ---------------------------------------------------

_DOC_ROW = re.compile(r"^\|\s*`([a-zA-Z_:][a-zA-Z0-9_:]*)`\s*\|\s*(\w+)\s*\|([^|]*)\|")


def doc_section(title: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """name → (type, label names) from the table under `## <title>` of docs/metrics.md.

    The labels column lists names, each optionally followed by its values in
    parentheses: `pool, state (used, free)` → (pool, state).
    """
    text = METRICS_DOC.read_text()
    parts = re.split(r"^## ", text, flags=re.M)
    (section,) = [p for p in parts if p.startswith(title)]
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for line in section.splitlines():
        m = _DOC_ROW.match(line.strip())
        if m:
            labels = re.sub(r"\([^)]*\)", "", m.group(3))
            names = tuple(w.strip() for w in labels.split(",") if w.strip())
            out[m.group(1)] = (m.group(2).lower(), names)
    return out


@pytest.mark.parametrize(
    ("title", "registry"),
    [("Engine", engine_registry), ("Operator", operator_registry), ("Gateway", gateway_registry)],
    ids=["engine", "operator", "gateway"],
)
def test_docs_match_registry(title: str, registry: Any) -> None:
    documented = doc_section(title)
    assert documented, f"no table under '## {title}' in docs/metrics.md"
    actual = registered(registry())
    assert set(documented) == set(actual), {
        "registered, not documented": sorted(set(actual) - set(documented)),
        "documented, not registered": sorted(set(documented) - set(actual)),
    }
    mismatched = {
        name: {"docs": documented[name], "code": actual[name]}
        for name in documented
        if (documented[name][0], sorted(documented[name][1]))
        != (actual[name][0], sorted(actual[name][1]))
    }
    assert not mismatched


def test_docs_tables_are_all_parsed() -> None:
    """The per-section parse and promql_names' whole-file parse agree."""
    every = {**doc_section("Engine"), **doc_section("Operator"), **doc_section("Gateway")}
    assert {n: k for n, (k, _) in every.items()} == documented_metrics(METRICS_DOC)


# --- label values exported at 0 from the start cover what the code counts -----------------


def _string_args(paths: list[Path], pattern: str) -> set[str]:
    found: set[str] = set()
    for path in paths:
        found |= set(re.findall(pattern, path.read_text()))
    return found


def test_reconcile_error_kinds_are_precreated() -> None:
    from loraplex_operator import metrics

    sources = sorted((REPO / "operator" / "loraplex_operator").glob("*.py"))
    kinds = _string_args(sources, r"RECONCILE_ERRORS\.labels\(kind=\"(\w+)\"\)")
    assert kinds, "no RECONCILE_ERRORS.labels(kind=...) found: the pattern is stale"
    assert kinds <= set(metrics.RECONCILE_ERROR_KINDS), kinds - set(metrics.RECONCILE_ERROR_KINDS)


def test_engine_failure_reasons_are_precreated() -> None:
    from loraplex_engine.metrics import FAILURE_REASONS

    engine = REPO / "trainer-image" / "loraplex_engine"
    tick = [engine / "tick/tick.py", engine / "tick/results.py"]
    # Failure(exp, reason, "kind") and guarded(exp, "kind", "what", step)
    failures = _string_args(tick, r"Failure\([^()]*?,\s*\"(\w+)\"\)")
    guarded = _string_args(tick, r"\bguarded\(\s*[\w.]+,\s*\"(\w+)\"")
    assert failures and guarded, "no Failure(..., kind) / guarded(exp, kind): the pattern is stale"
    kinds = failures | guarded
    assert kinds <= set(FAILURE_REASONS), kinds - set(FAILURE_REASONS)
    assert set(FAILURE_REASONS) <= kinds, "a listed reason the tick never reports"


def test_precreated_series_render_at_zero() -> None:
    from loraplex_engine.metrics import FAILURE_REASONS, EngineMetrics
    from loraplex_operator import metrics

    text = EngineMetrics().render().decode()
    for reason in FAILURE_REASONS:
        assert f'loraplex_engine_experiment_failures_total{{reason="{reason}"}} 0.0' in text
    metrics.set_pool("pool-zero", {}, engines=0, used=0, free=0)
    try:
        from prometheus_client import generate_latest

        text = generate_latest(metrics.REGISTRY).decode()
        for name in ("placements", "preemptions", "recoveries"):
            assert f'loraplex_{name}_total{{pool="pool-zero"}} 0.0' in text, name
        assert 'loraplex_scheduling_latency_seconds_count{pool="pool-zero"} 0.0' in text
        for kind in metrics.RECONCILE_ERROR_KINDS:
            assert f'loraplex_reconcile_errors_total{{kind="{kind}"}}' in text
    finally:
        metrics.forget_pool("pool-zero")
    text = generate_latest(metrics.REGISTRY).decode()
    assert 'pool="pool-zero"' not in text


def doc_label_values(title: str) -> dict[tuple[str, str], set[str]]:
    """(metric, label) → the values docs/metrics.md lists in parentheses after the label."""
    text = METRICS_DOC.read_text()
    (section,) = [p for p in re.split(r"^## ", text, flags=re.M) if p.startswith(title)]
    out: dict[tuple[str, str], set[str]] = {}
    for line in section.splitlines():
        m = _DOC_ROW.match(line.strip())
        if m:
            for label, values in re.findall(r"(\w+)\s*\(([^)]*)\)", m.group(3)):
                out[(m.group(1), label)] = {v.strip() for v in values.split(",")}
    return out


def _rendered_label_values(text: str) -> dict[tuple[str, str], set[str]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], set[str]] = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        for sample in family.samples:
            for label, value in sample.labels.items():
                out.setdefault((name, label), set()).add(value)
    return out


def test_documented_label_values_are_exported_from_the_start() -> None:
    """The values listed in the docs are exactly the ones a fresh process exports."""
    from loraplex_engine.metrics import EngineMetrics
    from loraplex_operator import metrics
    from loraplex_operator.gateway import metrics as gateway_metrics
    from prometheus_client import generate_latest

    engine = _rendered_label_values(EngineMetrics().render().decode())
    gateway = _rendered_label_values(generate_latest(gateway_metrics.REGISTRY).decode())
    metrics.set_pool("pool-doc", {}, engines=0, used=0, free=0)
    try:
        operator = _rendered_label_values(generate_latest(metrics.REGISTRY).decode())
    finally:
        metrics.forget_pool("pool-doc")
    for title, rendered in (("Engine", engine), ("Operator", operator), ("Gateway", gateway)):
        documented = doc_label_values(title)
        assert documented, title
        for key, values in documented.items():
            assert rendered.get(key) == values, (title, key, rendered.get(key), values)


def test_gateway_upstream_reasons_are_precreated() -> None:
    """Every reason upstream.transport_reason answers is exported at 0 from the start."""
    import httpx
    from loraplex_operator.gateway.metrics import UPSTREAM_REASONS
    from loraplex_operator.gateway.upstream import transport_reason

    request = httpx.Request("GET", "http://engine")
    errors = [httpx.ConnectError("x"), httpx.ConnectTimeout("x"), httpx.ReadTimeout("x")]
    errors += [httpx.RemoteProtocolError("x", request=request), httpx.ReadError("x")]
    assert {transport_reason(e) for e in errors} == set(UPSTREAM_REASONS)
