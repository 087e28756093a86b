"""Metric names in PromQL, Grafana dashboards, Prometheus rule files and docs/metrics.md.

Reusable: the chart tests compare the names that dashboards and alert rules use with
docs/metrics.md; test_metric_registrations.py compares them with what the engine and
operator register (prometheus-client registries) through the same functions.

Not a full PromQL parser: it removes strings, label matchers, range/subquery brackets,
grouping label lists and function calls, and takes the identifiers that are left. The
PromQL itself is checked by promtool (tests/chart/test_chart_dashboards.py,
test_chart_rules.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

# Words that look like identifiers but are not metric names.
KEYWORDS = frozenset(
    {
        "and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
        "group_right", "bool", "offset", "atan2", "inf", "nan", "start", "end",
    }
)  # fmt: skip
# Series Prometheus makes itself for every target (not exported by our code).
SYNTHETIC = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_NAME_MATCHER = re.compile(r'__name__\s*=\s*("(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\')')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(
    r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE
)
_GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_IDENT = re.compile(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])")
_LABEL_VALUES = re.compile(r"^\s*label_values\s*\((.*)\)\s*$", re.DOTALL)
_QUERY_RESULT = re.compile(r"^\s*query_result\s*\((.*)\)\s*$", re.DOTALL)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (Grafana variables allowed in it)."""
    names: set[str] = set()
    text = _GRAFANA_VAR.sub("x", expr)
    # {__name__="foo"} selects by name without a bare identifier.
    for quoted in _NAME_MATCHER.findall(text):
        names.add(quoted[1:-1])
    text = _STRING.sub('""', text)
    # Drop label matchers (innermost first), ranges, grouping label lists.
    while True:
        stripped = _BRACES.sub(" ", text)
        if stripped == text:
            break
        text = stripped
    text = _BRACKETS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    for match in _IDENT.finditer(text):
        word = match.group(1)
        after = text[match.end() :].lstrip()
        if after.startswith("("):  # a function call, e.g. rate(
            continue
        if word.lower() in KEYWORDS:
            continue
        names.add(word)
    return names


def grafana_query_names(query: str) -> set[str]:
    """Names in a Grafana Prometheus query or variable query (label_values, query_result)."""
    m = _LABEL_VALUES.match(query)
    if m:
        args = m.group(1)
        # label_values(label) has no metric; label_values(selector, label) has one.
        depth, split = 0, None
        for i, ch in enumerate(args):
            if ch in "({[":
                depth += 1
            elif ch in ")}]":
                depth -= 1
            elif ch == "," and depth == 0:
                split = i
        return metric_names(args[:split]) if split is not None else set()
    m = _QUERY_RESULT.match(query)
    if m:
        return metric_names(m.group(1))
    return metric_names(query)


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, query) for every panel target expr, every query variable and every
    Prometheus annotation of a dashboard."""
    out: list[tuple[str, str]] = []
    for ann in dashboard.get("annotations", {}).get("list", []):
        if ann.get("expr"):
            out.append((f"annotation {ann.get('name')!r}", ann["expr"]))
    for panel in _walk(dashboard.get("panels", [])):
        for target in panel.get("targets", []) or []:
            if isinstance(target, dict) and target.get("expr"):
                where = f"panel {panel.get('id')} {panel.get('title')!r} ref {target.get('refId')}"
                out.append((where, target["expr"]))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query", "")
        if query:
            out.append((f"variable {var.get('name')}", query))
    return out


def dashboard_names(dashboard: dict[str, Any] | str | Path) -> dict[str, set[str]]:
    """metric name → where it is used, for a dashboard (dict, JSON text or file path)."""
    if isinstance(dashboard, Path):
        dashboard = json.loads(dashboard.read_text())
    elif isinstance(dashboard, str):
        dashboard = json.loads(dashboard)
    used: dict[str, set[str]] = {}
    for where, query in dashboard_queries(dashboard):
        for name in grafana_query_names(query):
            used.setdefault(name, set()).add(where)
    return used


def rule_exprs(rules: dict[str, Any] | str | Path) -> list[tuple[str, str]]:
    """(rule name, expr) of a Prometheus rules file (or PrometheusRule spec)."""
    if isinstance(rules, Path):
        rules = yaml.safe_load(rules.read_text())
    elif isinstance(rules, str):
        rules = yaml.safe_load(rules)
    groups = rules.get("groups") or rules.get("spec", {}).get("groups", [])
    return [
        (rule.get("alert") or rule.get("record"), str(rule["expr"]))
        for group in groups
        for rule in group.get("rules", [])
    ]


def rules_names(rules: dict[str, Any] | str | Path) -> dict[str, set[str]]:
    """metric name → rules using it."""
    used: dict[str, set[str]] = {}
    for name, expr in rule_exprs(rules):
        for metric in metric_names(expr):
            used.setdefault(metric, set()).add(name)
    return used


_DOC_ROW = re.compile(r"^\|\s*`([a-zA-Z_:][a-zA-Z0-9_:]*)`\s*\|\s*(\w+)\s*\|")


def documented_metrics(doc: Path) -> dict[str, str]:
    """name → type (counter, gauge, histogram, ...) from the tables of docs/metrics.md."""
    out: dict[str, str] = {}
    for line in doc.read_text().splitlines():
        m = _DOC_ROW.match(line.strip())
        if m:
            out[m.group(1)] = m.group(2).lower()
    return out


def exported_series_names(metrics: dict[str, str]) -> set[str]:
    """Series names a registry with these metrics exposes (histogram → _bucket/_sum/_count)."""
    names: set[str] = set()
    for name, kind in metrics.items():
        if kind in ("histogram", "summary"):
            names.update(name + suffix for suffix in HISTOGRAM_SUFFIXES)
            if kind == "summary":
                names.add(name)
        else:
            names.add(name)
    return names


def unknown_names(used: Iterable[str], metrics: dict[str, str]) -> set[str]:
    """Names used that are neither exported per `metrics` nor synthetic (`up`, ...)."""
    allowed = exported_series_names(metrics) | SYNTHETIC
    return {name for name in used if name not in allowed}
