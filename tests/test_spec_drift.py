"""The experiment spec has two readers: the CRD (operator, API server) and the engine's
pydantic model. This test keeps them one schema: same fields, defaults, bounds, enums."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from loraplex_engine.spec import ExperimentSpec

from tests.conftest import REPO_ROOT

CRD = REPO_ROOT / "crds" / "loraexperiments.yaml"
CHECKED = ("type", "default", "minimum", "maximum", "enum", "exclusiveMinimum", "exclusiveMaximum")


def _crd_spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _pydantic_spec_schema() -> dict[str, Any]:
    schema = ExperimentSpec.model_json_schema(by_alias=True)
    defs = schema.pop("$defs")

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(defs[node["$ref"].rsplit("/", 1)[-1]])
            if "anyOf" in node:  # Optional[X] -> X (absence is how the CRD says None)
                options = [o for o in node["anyOf"] if o.get("type") != "null"]
                merged = {**resolve(options[0]), **{k: v for k, v in node.items() if k != "anyOf"}}
                return merged
            return {k: resolve(v) for k, v in node.items()}
        return node

    return resolve(schema)


def _normalise(node: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI v3.0 (CRD) and JSON Schema 2020 (pydantic) spell bounds differently."""
    out = {k: node[k] for k in CHECKED if k in node}
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        # CRD: minimum + exclusiveMinimum: true; pydantic: exclusiveMinimum: <bound>
        if isinstance(out.get(flag), bool) and out.pop(flag):
            out[flag] = out.pop(bound)
    if "const" in node:
        out["enum"] = [node["const"]]
    if out.get("default") is None:
        out.pop("default", None)
    if out.get("type") == "object":
        out.pop("default", None)  # CRD defaults {} so nested defaults apply; pydantic builds them
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "default"):
        if isinstance(out.get(key), int | float) and not isinstance(out.get(key), bool):
            out[key] = float(out[key])
    return out


def _leaves(node: dict[str, Any], path: str = "spec") -> dict[str, dict[str, Any]]:
    fields = {path: _normalise(node)}
    for name, child in (node.get("properties") or {}).items():
        fields |= _leaves(child, f"{path}.{name}")
    return fields


CRD_FIELDS = _leaves(_crd_spec_schema())
ENGINE_FIELDS = _leaves(_pydantic_spec_schema())


def test_same_fields() -> None:
    assert sorted(CRD_FIELDS) == sorted(ENGINE_FIELDS)


@pytest.mark.parametrize("path", sorted(CRD_FIELDS))
def test_same_type_default_bounds_and_enum(path: str) -> None:
    assert ENGINE_FIELDS.get(path) == CRD_FIELDS[path], path
