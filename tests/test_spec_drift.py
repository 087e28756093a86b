"""The experiment spec has two readers, the CRD (API server, operator) and the engine's
pydantic models; the models are the source and the CRD's spec schema is generated from
them (scripts/gen_crds.py). This test keeps the committed CRD equal to the generator's
output, and the generator honest: it refuses a constraint it cannot translate.

That both sides then judge values alike is checked on real values in
tests/operator/test_crd_schema.py (bounds) and test_crd_rules.py (CEL rules).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import ModuleType
from typing import Annotated, ClassVar

import pytest
import yaml
from loraplex_engine.spec import ExperimentSpec
from loraplex_engine.spec_schema import CelRule, ListSet, SpecModel
from pydantic import Field

from tests.conftest import REPO_ROOT

GEN = REPO_ROOT / "scripts" / "gen_crds.py"
CRD = REPO_ROOT / "crds" / "loraexperiments.yaml"


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_crds", GEN)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


def _committed_spec_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_committed_crd_is_the_generated_one() -> None:
    text = CRD.read_text()
    assert gen.generate(text) == text, "crds/loraexperiments.yaml is stale: run `make crds`"
    assert _committed_spec_schema() == gen.spec_schema()


def test_check_mode_agrees() -> None:
    proc = subprocess.run(
        [sys.executable, str(GEN), "--check"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_check_mode_reports_a_hand_edit(tmp_path, monkeypatch) -> None:
    edited = tmp_path / CRD.name
    edited.write_text(CRD.read_text().replace("maximum: 256", "maximum: 512", 1))
    monkeypatch.setattr(gen, "CRD", edited)
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0 and edited.read_text() == CRD.read_text()


def test_every_cel_rule_of_the_models_is_in_the_crd() -> None:
    schema = _committed_spec_schema()
    blocks = {
        ExperimentSpec: schema,
        **{
            field.annotation: schema["properties"][field.alias or name]
            for name, field in ExperimentSpec.model_fields.items()
            if isinstance(field.annotation, type) and issubclass(field.annotation, SpecModel)
        },
    }
    for model, node in blocks.items():
        crd_rules = node.get("x-kubernetes-validations", [])
        for rule in model.CEL_RULES:
            assert rule.as_crd() in crd_rules, (model.__name__, rule.message)


def test_generator_refuses_what_a_crd_cannot_say() -> None:
    class Tags(SpecModel):
        tags: set[str] = Field(default_factory=set)  # uniqueItems: not allowed in a CRD

    schema = Tags.model_json_schema()
    with pytest.raises(gen.SchemaError, match=r"spec\.tags: .*'uniqueItems'"):
        gen.to_openapi(schema, {})


def test_generator_translates_what_json_schema_spells_differently() -> None:
    class Block(SpecModel):
        CEL_RULES: ClassVar = (CelRule("self.a < 2.0", "a below 2", "a", lambda b: b.a < 2),)
        a: float = Field(1.0, gt=0, lt=2, description="An\n   a.")
        kind: str | None = None
        names: Annotated[list[str], ListSet()] = Field(default_factory=list)

    out = gen.to_openapi(Block.model_json_schema(), {})
    assert out["properties"]["a"] == {
        "type": "number",
        "description": "An a.",
        "default": 1.0,
        "minimum": 0,
        "exclusiveMinimum": True,
        "maximum": 2,
        "exclusiveMaximum": True,
    }
    assert out["properties"]["kind"] == {"type": "string"}  # Optional = may be absent
    assert out["properties"]["names"]["x-kubernetes-list-type"] == "set"
    assert out["x-kubernetes-validations"] == [{"rule": "self.a < 2.0", "message": "a below 2"}]
    assert "additionalProperties" not in out and "title" not in out
