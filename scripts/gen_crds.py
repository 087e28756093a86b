#!/usr/bin/env python3
"""Generate the CRDs' schemas from the typed API models.

Each block of a CRD between a ``# BEGIN <name>: generated ...`` and a ``# END <name>``
line is the OpenAPI form of one pydantic model: its types, bounds, patterns, lengths,
enums, defaults, descriptions and CEL rules. Everything outside the markers (names,
printer columns, the root schema) is kept by hand in the file.

- ``crds/loraexperiments.yaml``: ``spec`` from the engine's
  ``trainer-image/loraplex_engine/spec/experiment.py`` (the engine validates experiments itself),
  ``status`` from the operator's ``operator/loraplex_operator/api/status.py`` (the
  operator writes it);
- ``crds/enginepools.yaml``: ``spec`` and ``status`` from the operator's
  ``operator/loraplex_operator/api/`` (the operator reads pools and writes their status).

    scripts/gen_crds.py           rewrite the generated blocks (then scripts/sync-chart-crds.sh)
    scripts/gen_crds.py --check   exit 1 if a committed CRD differs from what it would write

`make crds` does both steps; tests/test_spec_drift.py runs --check.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
# This checkout's models, not an installed copy.
sys.path[:0] = [str(REPO / "trainer-image"), str(REPO / "operator")]

from loraplex_engine.spec.experiment import ExperimentSpec  # noqa: E402
from loraplex_operator.api.pool import EnginePoolSpec  # noqa: E402
from loraplex_operator.api.status import EnginePoolStatus, ExperimentStatus  # noqa: E402

CEL_KEY = "x-kubernetes-validations"
PRESERVE_UNKNOWN = "x-kubernetes-preserve-unknown-fields"

# JSON Schema keywords that mean the same in a CRD's OpenAPI v3 schema.
SAME = {
    "type", "format", "description", "enum", "default", "minimum", "maximum",
    "minLength", "maxLength", "pattern", "minItems", "maxItems", "minProperties",
    "maxProperties", "required",
}  # fmt: skip
# The order keys are written in (readers look for type and description first).
ORDER = [
    "type", "format", "description", "enum", "default", "minimum", "exclusiveMinimum",
    "maximum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems",
    "maxItems", "minProperties", "maxProperties", "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys", PRESERVE_UNKNOWN, "required", CEL_KEY, "properties",
    "items", "additionalProperties",
]  # fmt: skip


class SchemaError(ValueError):
    """A pydantic constraint with no CRD form: failing beats dropping it silently."""


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Inline ``$ref`` (the field's own keys win, CEL rules of both are kept) and turn
    ``Optional[X]`` (``anyOf [X, null]``) into X: the CRD says None by absence."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        own = {k: v for k, v in node.items() if k != "$ref"}
        merged = {**target, **own}
        rules = own.get(CEL_KEY, []) + target.get(CEL_KEY, [])
        if rules:
            merged[CEL_KEY] = rules
        return _resolve(merged, defs)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o != {"type": "null"}]
        if len(options) != 1:
            raise SchemaError(f"a union of {options} has no CRD form")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if rest.get("default", 0) is None:
            del rest["default"]
        return _resolve({**options[0], **rest}, defs)
    return node


def to_openapi(node: dict[str, Any], defs: dict[str, Any], path: str = "spec") -> dict[str, Any]:
    """One JSON Schema (pydantic) node as a CRD's structural OpenAPI v3 node."""
    out: dict[str, Any] = {}
    for key, value in _resolve(node, defs).items():
        if key == "title":
            continue  # pydantic's, from the Python name; the description says it better
        if key == "additionalProperties" and value is False:
            continue  # extra="forbid": the API server prunes (or refuses) unknown fields
        if key == "additionalProperties" and value is True:
            out[PRESERVE_UNKNOWN] = True  # extra="allow", dict[str, Any]: kept as written
            continue
        if key == "properties":
            out[key] = {n: to_openapi(s, defs, f"{path}.{n}") for n, s in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = to_openapi(value, defs, f"{path}[]" if key == "items" else f"{path}{{}}")
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            # JSON Schema 2020: exclusiveMinimum: 0; OpenAPI v3.0: minimum: 0 + the flag.
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "const":
            out["enum"] = [value]
        elif key == "description":
            out[key] = " ".join(value.split())  # docstrings wrap; kubectl explain re-wraps
        elif key == CEL_KEY:
            out[key] = [{"rule": r["rule"], "message": r["message"]} for r in value]
        elif key in SAME or key.startswith("x-kubernetes-"):
            out[key] = value
        else:
            raise SchemaError(f"{path}: JSON Schema keyword {key!r} has no CRD form here")
    unknown = sorted(set(out) - set(ORDER))
    return {k: out[k] for k in [*ORDER, *unknown] if k in out}


def model_schema(model: type[BaseModel], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """A model's CRD schema; ``required`` adds names the CRD requires and Python does not."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    defs = schema.pop("$defs", {})
    out = to_openapi(schema, defs)
    if required or out.get("required"):
        out["required"] = [*required, *out.get("required", [])]
    return {k: out[k] for k in ORDER if k in out}


def spec_schema() -> dict[str, Any]:
    """The LoRAExperiment CRD's ``properties.spec``, from ``ExperimentSpec``."""
    return model_schema(ExperimentSpec, ExperimentSpec.CLUSTER_REQUIRED)


class Block(NamedTuple):
    """One generated property of a CRD's root schema, between its marker lines."""

    name: str
    source: str  # named in the BEGIN line, so a reader of the YAML knows what to edit
    schema: Callable[[], dict[str, Any]]

    @property
    def begin(self) -> str:
        return f"# BEGIN {self.name}: generated by scripts/gen_crds.py from {self.source}"

    @property
    def end(self) -> str:
        return f"# END {self.name}"


class Crd(NamedTuple):
    path: Path
    blocks: tuple[Block, ...]


CRDS = (
    Crd(
        REPO / "crds" / "loraexperiments.yaml",
        (
            Block("spec", "loraplex_engine/spec/experiment.py", spec_schema),
            Block(
                "status",
                "loraplex_operator/api/status.py",
                lambda: model_schema(ExperimentStatus),
            ),
        ),
    ),
    Crd(
        REPO / "crds" / "enginepools.yaml",
        (
            Block("spec", "loraplex_operator/api/pool.py", lambda: model_schema(EnginePoolSpec)),
            Block(
                "status",
                "loraplex_operator/api/status.py",
                lambda: model_schema(EnginePoolStatus),
            ),
        ),
    ),
)


class _Dumper(yaml.SafeDumper):
    """Block style with indented lists; lists of scalars on one line."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        return super().increase_indent(flow, False)


def _list(dumper: yaml.SafeDumper, items: list[Any]) -> yaml.Node:
    flat = all(not isinstance(i, dict | list) for i in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=flat)


_Dumper.add_representer(list, _list)


def render_block(block: Block, indent: str) -> str:
    text = yaml.dump(
        {block.name: block.schema()},
        Dumper=_Dumper,
        sort_keys=False,
        allow_unicode=True,
        width=88,
    )
    lines = [
        indent + block.begin,
        *(indent + line for line in text.splitlines()),
        indent + block.end,
    ]
    lines = [line.rstrip() for line in lines]
    return "\n".join(lines) + "\n"


def _rewrite(block: Block, name: str, current: str) -> str:
    lines = current.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == block.begin]
    ends = [i for i, line in enumerate(lines) if line.strip() == block.end]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise SchemaError(
            f"{name}: expected one {block.begin!r} line and one {block.end!r} after it"
        )
    begin, end = starts[0], ends[0]
    indent = lines[begin][: len(lines[begin]) - len(lines[begin].lstrip())]
    return "".join(lines[:begin]) + render_block(block, indent) + "".join(lines[end + 1 :])


def generate(current: str, crd: Crd = CRDS[0]) -> str:
    """``current`` (the text of ``crd``) with every generated block rewritten."""
    for block in crd.blocks:
        current = _rewrite(block, crd.path.name, current)
    return current


def main(argv: list[str] | None = None, crds: tuple[Crd, ...] = CRDS) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="report drift, write nothing")
    args = parser.parse_args(argv)
    drift = 0
    for crd in crds:
        current = crd.path.read_text()
        wanted = generate(current, crd)
        if wanted == current:
            continue
        sources = " and ".join(b.source for b in crd.blocks)
        if args.check:
            print(
                f"drift: crds/{crd.path.name} differs from {sources}; run `make crds`",
                file=sys.stderr,
            )
            drift = 1
        else:
            crd.path.write_text(wanted)
            print(f"wrote crds/{crd.path.name} (from {sources})")
    return drift


if __name__ == "__main__":
    sys.exit(main())
