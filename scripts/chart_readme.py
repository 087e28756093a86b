#!/usr/bin/env python3
"""Write charts/loraplex/README.md from the chart's values.yaml `# --` comments.

A minimal stand-in for helm-docs (not installable here), with its convention: a comment
block whose first line starts with `# --`, directly above a key, documents that key;
later `#` lines of the block continue it. A documented map documents everything under
it (its default is the whole map). The page is README.md.tmpl with `{{ values_table }}`
and `{{ name }}`, `{{ version }}`, `{{ appVersion }}`, `{{ description }}`,
`{{ kubeVersion }}` of Chart.yaml filled in.

    python scripts/chart_readme.py           # write the README
    python scripts/chart_readme.py --check   # exit 1 if the README or the docs lag
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "charts" / "loraplex"
KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?:\s|$)")
COMMENT = re.compile(r"^ *#(?P<text>.*)$")


def documented_keys(values_text: str) -> dict[str, str]:
    """Dotted key → its `# --` description, in file order."""
    docs: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing maps
    block: list[str] = []  # the comment lines right above the current line
    for line in values_text.splitlines():
        comment = COMMENT.match(line)
        if comment:
            block.append(comment["text"].strip())
            continue
        key = KEY.match(line)
        if key is None:  # a list item, a blank line, a continued value
            block = []
            continue
        indent = len(key["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [key["key"]])
        stack.append((indent, key["key"]))
        start = next((i for i, text in enumerate(block) if text.startswith("--")), None)
        if start is not None:
            words = [block[start][2:].strip(), *block[start + 1 :]]
            docs[path] = " ".join(w for w in words if w)
        block = []
    return docs


def _lookup(values: dict[str, Any], path: str) -> Any:
    value: Any = values
    for part in path.split("."):
        value = value[part]
    return value


def _leaves(values: Any, prefix: str = "") -> list[str]:
    if isinstance(values, dict) and values:
        return [leaf for k, v in values.items() for leaf in _leaves(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")]


def undocumented(values_text: str) -> list[str]:
    """Leaf values with no `# --` comment on themselves or on a map above them."""
    docs = documented_keys(values_text)
    values = yaml.safe_load(values_text)

    def covered(leaf: str) -> bool:
        parts = leaf.split(".")
        return any(".".join(parts[:n]) in docs for n in range(1, len(parts) + 1))

    return [leaf for leaf in _leaves(values) if not covered(leaf)]


def _type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, str):
        return "string"
    return "list" if isinstance(value, list) else "object"


def _cell(text: str) -> str:
    """Table-safe: `|` escaped, and `<x>` shown rather than taken for an HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def values_table(values_text: str) -> str:
    values = yaml.safe_load(values_text)
    rows = ["| Key | Type | Default | Description |", "|-----|------|---------|-------------|"]
    for key, description in documented_keys(values_text).items():
        value = _lookup(values, key)
        default = json.dumps(value, separators=(",", ":")).replace("|", "\\|")
        rows.append(f"| {key} | {_type(value)} | `{default}` | {_cell(description)} |")
    return "\n".join(rows)


def readme(chart: Path = CHART) -> str:
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    page = (chart / "README.md.tmpl").read_text()
    fields = {k: str(meta.get(k, "")) for k in ("name", "version", "appVersion", "kubeVersion")}
    fields["description"] = " ".join(str(meta.get("description", "")).split())
    fields["values_table"] = values_table((chart / "values.yaml").read_text())
    for name, text in fields.items():
        page = page.replace("{{ " + name + " }}", text)
    return page


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    missing = undocumented((CHART / "values.yaml").read_text())
    if missing:
        print(f"values.yaml: no `# --` comment for {', '.join(missing)}", file=sys.stderr)
        return 1
    text, target = readme(), CHART / "README.md"
    if args.check:
        if not target.exists() or target.read_text() != text:
            print(f"{target} is stale: run python scripts/chart_readme.py", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
