"""The chart README is generated from values.yaml's `# --` comments (scripts/chart_readme.py),
every user-facing value has one, and the committed README is the generator's output."""

from __future__ import annotations

import importlib.util

import yaml

from tests.support.chart_helpers import CHART, REPO

spec = importlib.util.spec_from_file_location("chart_readme", REPO / "scripts" / "chart_readme.py")
assert spec is not None and spec.loader is not None
chart_readme = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chart_readme)

VALUES = (CHART / "values.yaml").read_text()


def test_committed_readme_is_the_generators_output() -> None:
    assert (CHART / "README.md").read_text() == chart_readme.readme(), (
        "charts/loraplex/README.md is stale: run python scripts/chart_readme.py"
    )


def test_every_value_is_documented() -> None:
    assert chart_readme.undocumented(VALUES) == []
    table = chart_readme.values_table(VALUES)
    for key in chart_readme.documented_keys(VALUES):
        assert f"| {key} |" in table


def test_the_generator_reads_the_helm_docs_convention() -> None:
    text = """\
# file header, not a value's doc
top:
  # -- A documented map: its children need no comment
  # and this line continues it.
  whole:
    a: 1
    b: [x]
  # a plain comment documents nothing
  bare: 2
  nested:
    # -- Leaf.
    leaf: "s"
"""
    docs = chart_readme.documented_keys(text)
    assert docs == {
        "top.whole": "A documented map: its children need no comment and this line continues it.",
        "top.nested.leaf": "Leaf.",
    }
    assert chart_readme.undocumented(text) == ["top.bare"]
    table = chart_readme.values_table(text)
    assert '| top.whole | object | `{"a":1,"b":["x"]}` |' in table
    assert yaml.safe_load(text)["top"]["bare"] == 2  # the sample is valid YAML
