"""Alert rules: promtool check and unit tests, and conventions."""

from __future__ import annotations

import re
import subprocess

import yaml

from tests.support.chart_helpers import REPO, RULES_FILE, RULES_TEST, tool

RUNBOOKS = REPO / "docs" / "runbooks.md"
# The chart's monitoring.prometheusRule.runbookUrl replaces this base (values.yaml).
RUNBOOK_BASE = "https://loraplex.invalid/docs/runbooks.md"


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(tool("promtool")), *args], capture_output=True, text=True, timeout=300
    )


def test_promtool_check_rules() -> None:
    proc = _promtool("check", "rules", str(RULES_FILE))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_test_rules() -> None:
    proc = _promtool("test", "rules", str(RULES_TEST))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def _alerts() -> list[dict]:
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_every_alert_has_a_unit_test() -> None:
    tested = set(re.findall(r"alertname: (\w+)", RULES_TEST.read_text()))
    alerts = {rule["alert"] for rule in _alerts()}
    assert alerts <= tested, f"alerts without a unit test: {sorted(alerts - tested)}"


def test_alert_conventions() -> None:
    names = set()
    for rule in _alerts():
        name = rule["alert"]
        assert re.fullmatch(r"Loraplex[A-Z][A-Za-z]+", name), name
        assert name not in names, f"duplicate alert {name}"
        names.add(name)
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"].strip(), name
        assert len(rule["annotations"]["description"]) > 40, name


def _runbook_sections() -> dict[str, str]:
    """`## Heading` → its text, from docs/runbooks.md."""
    parts = re.split(r"^## ", RUNBOOKS.read_text(), flags=re.M)[1:]
    return {p.split("\n", 1)[0].strip(): p.split("\n", 1)[1] for p in parts}


def test_every_alert_links_its_runbook_section() -> None:
    sections = _runbook_sections()
    alerts = {rule["alert"]: rule for rule in _alerts()}
    assert set(sections) == set(alerts), {
        "alerts without a section": sorted(set(alerts) - set(sections)),
        "sections without an alert": sorted(set(sections) - set(alerts)),
    }
    for name, rule in alerts.items():
        # GitHub/GitLab anchor of "## LoraplexFoo" is "#loraplexfoo".
        assert rule["annotations"]["runbook_url"] == f"{RUNBOOK_BASE}#{name.lower()}", name
        for part in ("**Means.**", "**Check.**", "**Do.**"):
            assert part in sections[name], (name, part)


def test_runbook_cross_links_resolve() -> None:
    anchors = {name.lower() for name in _runbook_sections()}
    links = re.findall(r"\]\(#([^)]+)\)", RUNBOOKS.read_text())
    assert links and set(links) <= anchors, set(links) - anchors


def test_required_alerts_exist() -> None:
    alerts = {rule["alert"] for rule in _alerts()}
    assert {
        "LoraplexExperimentStuckPending",
        "LoraplexEngineDown",
        "LoraplexExperimentFailures",
        "LoraplexRewardNaN",
        "LoraplexExperimentNoProgress",
        "LoraplexReconcileErrors",
    } <= alerts
