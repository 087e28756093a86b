"""Grafana dashboards (charts/loraplex/dashboards/*.json) checked as JSON, and their
PromQL checked by promtool (no Grafana server is installable here)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.chart_helpers import DASHBOARDS, tool
from tests.support.promql_names import dashboard_queries

# Grafana's built-in variables ($__rate_interval, ${__data.fields.x}, ...).
BUILTINS = {
    "__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms",
    "__from", "__to", "__url_time_range", "__data", "__field", "__series", "__value",
    "__dashboard", "__org", "__user", "__timeFilter", "__name", "timeFilter",
}  # fmt: skip
# Values for a syntax check of queries that contain Grafana variables.
SUBSTITUTE = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
_VAR = re.compile(r"\$\{([A-Za-z_][\w]*)(?:[.:][^}]*)?\}|\$([A-Za-z_]\w*)|\[\[(\w+)\]\]")
EXPECTED = {"loraplex-fleet.json", "loraplex-experiment.json"}


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dash["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for v in node.values() for s in _strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in _strings(v)]
    return []


def _variables(dash: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dash["templating"]["list"]}


def test_expected_dashboards() -> None:
    assert {p.name for p in DASHBOARDS} == EXPECTED
    uids = [_load(p)["uid"] for p in DASHBOARDS]
    assert len(set(uids)) == len(uids)


@pytest.fixture(params=DASHBOARDS, ids=lambda p: p.stem)
def dash(request: pytest.FixtureRequest) -> dict[str, Any]:
    return _load(request.param)


def test_metadata(dash: dict[str, Any]) -> None:
    assert dash["title"].startswith("loraplex / ")
    assert re.fullmatch(r"[a-z0-9-]{1,40}", dash["uid"])
    assert "loraplex" in dash["tags"]
    assert dash["schemaVersion"] >= 36
    assert dash["description"]
    assert "id" not in dash or dash["id"] is None, "exported with a database id"


def test_unique_panel_ids(dash: dict[str, Any]) -> None:
    ids = [p["id"] for p in _panels(dash)]
    assert all(isinstance(i, int) for i in ids)
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"


def test_layout_fits_and_does_not_overlap(dash: dict[str, Any]) -> None:
    cells: dict[tuple[int, int], int] = {}
    for panel in _panels(dash):
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps panel {cells[(x, y)]}"
                cells[(x, y)] = panel["id"]


def test_datasource_variable_is_used(dash: dict[str, Any]) -> None:
    variables = _variables(dash)
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    want = {"type": "prometheus", "uid": "${datasource}"}
    for panel in _panels(dash):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == want, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == want, (panel["title"], target["refId"])
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"] == want, var["name"]


def test_every_variable_used_is_defined(dash: dict[str, Any]) -> None:
    defined = set(_variables(dash))
    used: set[str] = set()
    for text in _strings(dash["panels"]) + _strings(dash["templating"]):
        for m in _VAR.finditer(text):
            used.add(next(g for g in m.groups() if g))
    undefined = used - defined - BUILTINS
    assert not undefined, f"undefined variables: {sorted(undefined)}"
    # and every defined variable is used somewhere (other than its own definition)
    for name in _variables(dash):
        others = [v for n, v in _variables(dash).items() if n != name]
        texts = _strings(dash["panels"]) + _strings(others)
        assert any(re.search(rf"\$\{{?{name}\b", t) for t in texts), f"unused variable {name}"


def test_panels_are_described(dash: dict[str, Any]) -> None:
    for panel in _panels(dash):
        if panel["type"] == "row":
            continue
        assert panel["title"].strip(), panel["id"]
        assert len(panel.get("description", "")) > 15, panel["title"]
        defaults = panel["fieldConfig"]["defaults"]
        if panel["type"] in ("timeseries", "stat", "bargauge", "piechart"):
            assert defaults.get("unit"), f"{panel['title']!r} has no unit"
        if panel["type"] == "timeseries":
            assert panel["options"]["legend"]["showLegend"], panel["title"]
            for target in panel["targets"]:
                assert target.get("legendFormat"), (panel["title"], target["refId"])


def test_units_match_metrics(dash: dict[str, Any]) -> None:
    """Seconds histograms are shown in seconds, bytes in bytes, ratios in percent."""
    for panel in _panels(dash):
        if panel["type"] == "row":
            continue
        unit = panel["fieldConfig"]["defaults"].get("unit")
        exprs = " ".join(t["expr"] for t in panel["targets"])
        if "histogram_quantile" in exprs and "_seconds_bucket" in exprs:
            assert unit == "s", panel["title"]
        if "memory_bytes" in exprs:
            assert unit == "bytes", panel["title"]
        if "busy_ratio" in exprs:
            assert unit == "percentunit", panel["title"]


def test_links_point_to_existing_dashboards() -> None:
    uids = {_load(p)["uid"] for p in DASHBOARDS}
    for path in DASHBOARDS:
        for text in _strings(_load(path)["panels"]):
            for uid in re.findall(r"/d/([a-z0-9-]+)", text):
                assert uid in uids, f"{path.name} links to unknown dashboard {uid}"


def _substitute(query: str, variables: dict[str, dict[str, Any]]) -> str:
    def repl(m: re.Match) -> str:
        name = next(g for g in m.groups() if g)
        if name in SUBSTITUTE:
            return SUBSTITUTE[name]
        assert name in variables, name
        return "x"

    return _VAR.sub(repl, query)


def test_promql_parses(tmp_path: Path) -> None:
    """Every panel query and variable selector, variables filled in, passes promtool."""
    rules = []
    for path in DASHBOARDS:
        dash = _load(path)
        variables = _variables(dash)
        for i, (where, query) in enumerate(dashboard_queries(dash)):
            m = re.match(r"^\s*label_values\((.*),\s*\w+\)\s*$", query, re.DOTALL)
            expr = m.group(1) if m else query
            expr = _substitute(expr, variables)
            rules.append({"record": f"dashboard:check_{path.stem.replace('-', '_')}_{i}",
                          "expr": expr, "labels": {"where": where}})  # fmt: skip
    file = tmp_path / "dashboard-queries.yaml"
    file.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    proc = subprocess.run(
        [str(tool("promtool")), "check", "rules", str(file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(rules) > 30


def test_experiment_dashboard_variables() -> None:
    dash = _load(next(p for p in DASHBOARDS if p.name == "loraplex-experiment.json"))
    assert list(_variables(dash)) == ["datasource", "namespace", "pool", "experiment"]
