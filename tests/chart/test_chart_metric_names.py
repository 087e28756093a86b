"""Dashboards and alert rules use only the metric names of docs/metrics.md.

test_metric_registrations.py checks the same names against what the engine and operator
register; test_prometheus_live.py runs every dashboard query against live processes.
"""

from __future__ import annotations

import pytest

from tests.support.chart_helpers import DASHBOARDS, METRICS_DOC, RULES_FILE
from tests.support.promql_names import (
    dashboard_names,
    documented_metrics,
    grafana_query_names,
    metric_names,
    rules_names,
    unknown_names,
)


def test_doc_tables_parse() -> None:
    metrics = documented_metrics(METRICS_DOC)
    assert len(metrics) >= 15
    assert metrics["loraplex_engine_tick_seconds"] == "histogram"
    assert metrics["loraplex_placements_total"] == "counter"
    for name, kind in metrics.items():
        assert name.startswith("loraplex_"), name
        assert name.endswith("_total") == (kind == "counter"), name


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_names_documented(path) -> None:
    used = dashboard_names(path)
    assert used, "no metric found: the extraction is broken"
    unknown = unknown_names(used, documented_metrics(METRICS_DOC))
    assert not unknown, {name: sorted(used[name]) for name in unknown}


def test_rules_names_documented() -> None:
    used = rules_names(RULES_FILE)
    assert used
    unknown = unknown_names(used, documented_metrics(METRICS_DOC))
    assert not unknown, {name: sorted(used[name]) for name in unknown}


def test_histograms_are_read_through_their_series() -> None:
    """A histogram's base name is not a series: read _bucket, _sum or _count."""
    metrics = documented_metrics(METRICS_DOC)
    histograms = {n for n, k in metrics.items() if k == "histogram"}
    used = set(rules_names(RULES_FILE))
    for path in DASHBOARDS:
        used |= set(dashboard_names(path))
    assert not used & histograms


def test_dashboards_cover_the_fleet_metrics() -> None:
    """The fleet view shows every operator metric and the engine's main ones."""
    fleet = next(p for p in DASHBOARDS if p.name == "loraplex-fleet.json")
    used = set(dashboard_names(fleet))
    for name in (
        "loraplex_experiments",
        "loraplex_pool_slots",
        "loraplex_scheduling_latency_seconds_bucket",
        "loraplex_engine_busy_ratio",
        "loraplex_preemptions_total",
        "loraplex_recoveries_total",
        "loraplex_engine_rollout_tokens_total",
        "loraplex_engine_steps_total",
        "loraplex_experiment_phase",
        "loraplex_experiment_restarts",
        "loraplex_experiment_step",
        "loraplex_experiment_max_steps",
    ):
        assert name in used, name


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (pool) (rate(a_total{pool=~"$pool"}[$__rate_interval]))', {"a_total"}),
        ("histogram_quantile(0.9, sum by (le) (rate(h_bucket[5m] offset 1h)))", {"h_bucket"}),
        ("a and on (pod) b unless ignoring (x, y) c > bool 1e3", {"a", "b", "c"}),
        ('{__name__="by_name", job="x"} or absent(up{job="y"})', {"by_name", "up"}),
        ("count(x) / scalar(y) * on() group_left(z) w", {"x", "y", "w"}),
        ('label_replace(m, "dst", "$1", "src", "(.*)")', {"m"}),
        ("max_over_time(g[5m:1m])", {"g"}),
    ],
)
def test_metric_names_extraction(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_grafana_variable_queries() -> None:
    assert grafana_query_names('label_values(m{a="$b"}, pool)') == {"m"}
    assert grafana_query_names("label_values(pool)") == set()
    assert grafana_query_names("query_result(topk(3, rate(c_total[5m])))") == {"c_total"}
