"""Alert rules: promtool check and unit tests, and conventions."""

from __future__ import annotations

import re
import subprocess

import yaml
from chart_helpers import RULES_FILE, RULES_TEST, tool


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
