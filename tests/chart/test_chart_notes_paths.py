"""Every file NOTES.txt and the chart README point to exists, in the chart or the
repository (a path names either; globs must match something)."""

from __future__ import annotations

import re

import pytest

from tests.support.chart_helpers import CHART, REPO, SCENARIOS, render_notes

# A relative path with a directory part or a known extension: samples/pool-cpu.yaml,
# charts/loraplex/dashboards/*.json, docs/runbooks.md, rbac-contract.yaml.
PATH = re.compile(
    r"(?<![\w/.:-])((?:[\w.*-]+/)*[\w*-][\w.*-]*\.(?:ya?ml|json|md|txt|sh|py|tpl))(?![\w/])"
)


def referenced_paths(text: str) -> set[str]:
    return {m.group(1) for m in PATH.finditer(text) if "://" not in m.group(1)}


def missing(paths: set[str]) -> list[str]:
    return sorted(p for p in paths if not (any(REPO.glob(p)) or any(CHART.glob(p))))


@pytest.mark.parametrize("scenario", ["default", "all-on", "namespaced-all-on", "minimal"])
def test_notes_point_to_files_that_exist(scenario: str) -> None:
    paths = referenced_paths(render_notes(SCENARIOS[scenario]))
    assert paths, "NOTES name no files: the check would pass vacuously"
    assert missing(paths) == []


def test_readme_points_to_files_that_exist() -> None:
    paths = referenced_paths((CHART / "README.md.tmpl").read_text())
    assert {"samples/pool-cpu.yaml", "rbac-contract.yaml", "docs/runbooks.md"} <= paths
    assert missing(paths) == []


def test_the_check_finds_a_missing_file() -> None:
    paths = referenced_paths("see samples/nope.yaml and docs/runbooks.md, https://x.invalid/a.md")
    assert paths == {"samples/nope.yaml", "docs/runbooks.md"}
    assert missing(paths) == ["samples/nope.yaml"]
