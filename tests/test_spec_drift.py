"""Both CRDs are generated from typed models (scripts/gen_crds.py): the LoRAExperiment
spec from the engine's pydantic models (loraplex_engine/spec/experiment.py), its status and the
EnginePool spec and status from the operator's (loraplex_operator/api/). The models are
the source; these tests keep the committed CRDs equal to the generator's output (and `make
crds` a no-op on a clean checkout), and the generator honest: it refuses a constraint it
cannot translate.

That both sides then judge values alike is checked on real values in
tests/operator/api/test_crd_schema.py (bounds) and test_crd_rules.py (CEL rules).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, ClassVar

import pytest
import yaml
from loraplex_engine.spec.experiment import ExperimentSpec
from loraplex_engine.spec.schema import CelRule, ListSet, SpecModel
from loraplex_operator.api.pool import EnginePoolSpec
from loraplex_operator.api.schema import ApiModel
from loraplex_operator.api.status import EnginePoolStatus, ExperimentStatus
from pydantic import Field

from tests.support.paths import REPO_ROOT

GEN = REPO_ROOT / "scripts" / "gen_crds.py"
CRD = REPO_ROOT / "crds" / "loraexperiments.yaml"
POOL_CRD = REPO_ROOT / "crds" / "enginepools.yaml"


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_crds", GEN)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()
CRD_NAMES = [crd.path.name for crd in gen.CRDS]


def _committed(path: Path, block: str = "spec") -> dict[str, Any]:
    crd = yaml.safe_load(path.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][block]


def _committed_spec_schema() -> dict[str, Any]:
    return _committed(CRD)


def test_both_crds_are_generated() -> None:
    assert {c.path for c in gen.CRDS} == {CRD, POOL_CRD}
    assert {(c.path.name, b.name) for c in gen.CRDS for b in c.blocks} == {
        ("loraexperiments.yaml", "spec"),
        ("loraexperiments.yaml", "status"),
        ("enginepools.yaml", "spec"),
        ("enginepools.yaml", "status"),
    }


@pytest.mark.parametrize("crd", gen.CRDS, ids=CRD_NAMES)
def test_committed_crd_is_the_generated_one(crd: Any) -> None:
    text = crd.path.read_text()
    assert gen.generate(text, crd) == text, f"crds/{crd.path.name} is stale: run `make crds`"
    for block in crd.blocks:
        assert _committed(crd.path, block.name) == block.schema()


def test_check_mode_agrees() -> None:
    proc = subprocess.run(
        [sys.executable, str(GEN), "--check"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("crd", gen.CRDS, ids=CRD_NAMES)
def test_check_mode_reports_a_hand_edit(crd: Any, tmp_path: Path) -> None:
    edited = crd._replace(path=tmp_path / crd.path.name)
    edited.path.write_text(crd.path.read_text().replace("maximum: 256", "maximum: 512", 1))
    assert edited.path.read_text() != crd.path.read_text()
    assert gen.main(["--check"], (edited,)) == 1
    assert gen.main([], (edited,)) == 0 and edited.path.read_text() == crd.path.read_text()


def _scratch_checkout(tmp_path: Path) -> Path:
    """What `make crds` reads and writes, copied (the models are linked: read only)."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(REPO_ROOT / "Makefile", root)
    for part in ("scripts", "crds", "charts/loraplex/crds"):
        shutil.copytree(REPO_ROOT / part, root / part)
    for part in ("trainer-image", "operator"):
        (root / part).symlink_to(REPO_ROOT / part)
    return root


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_crds_regenerates_both_crds_byte_identical(tmp_path: Path) -> None:
    root = _scratch_checkout(tmp_path)
    # A stale chart copy and a hand-edited block, which `make crds` must both undo.
    (root / "charts/loraplex/crds/loraexperiments.yaml").write_text("stale\n")
    pool = root / "crds" / POOL_CRD.name
    edited = pool.read_text().replace("default: loraplex-system", "default: x", 1)
    assert edited != pool.read_text()
    pool.write_text(edited)
    # -o: the scratch tree has no venv to (re)install; this interpreter runs the scripts.
    make = ["make", "-s", "-C", str(root), "-o", ".venv/.installed", f"PY={sys.executable}"]
    proc = subprocess.run([*make, "crds"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for path in (CRD, POOL_CRD):
        for copy in (root / "crds" / path.name, root / "charts/loraplex/crds" / path.name):
            assert copy.read_bytes() == path.read_bytes(), copy
    again = subprocess.run([*make, "crds"], capture_output=True, text=True, check=False)
    assert again.returncode == 0 and "wrote" not in again.stdout + again.stderr
    assert "copied" not in again.stdout


def _model_blocks(model: type, schema: dict[str, Any]) -> dict[type, dict[str, Any]]:
    """The model and each nested model field, with its node in the CRD schema."""
    blocks = {model: schema}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        args = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
        nested = args[0] if len(args) == 1 else annotation
        if isinstance(nested, type) and issubclass(nested, SpecModel | ApiModel):
            node = schema["properties"][field.alias or name]
            # a list of objects (spec.publish.aliases): the model is the items'
            blocks |= _model_blocks(nested, node.get("items", node))
    return blocks


@pytest.mark.parametrize(
    ("model", "path", "block"),
    [
        (ExperimentSpec, CRD, "spec"),
        (EnginePoolSpec, POOL_CRD, "spec"),
        (ExperimentStatus, CRD, "status"),
        (EnginePoolStatus, POOL_CRD, "status"),
    ],
    ids=["experiment-spec", "experiment-status", "pool-spec", "pool-status"],
)
def test_every_cel_rule_of_the_models_is_in_the_crd(model: type, path: Path, block: str) -> None:
    blocks = _model_blocks(model, _committed(path, block))
    for nested, node in blocks.items():
        crd_rules = node.get("x-kubernetes-validations", [])
        for rule in nested.CEL_RULES:
            assert rule.as_crd() in crd_rules, (nested.__name__, rule.message)
    if model is EnginePoolSpec:  # the pool's rules sit on the spec, replicas, shape, template
        assert sum(len(m.CEL_RULES) for m in blocks) == 7


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


def test_generator_keeps_open_objects_open() -> None:
    # extra="allow" and dict[str, Any] (core/v1 parts of the pod template) are kept as
    # written by the API server: x-kubernetes-preserve-unknown-fields, not a closed object.
    from loraplex_operator.api.schema import OpenModel

    class Volume(OpenModel):
        name: str = Field(description="n")

    class Block(ApiModel):
        volume: Volume | None = None
        source: dict[str, Any] | None = None
        labels: dict[str, str] | None = None

    out = gen.model_schema(Block)["properties"]
    assert out["volume"]["x-kubernetes-preserve-unknown-fields"] is True
    assert out["volume"]["properties"] == {"name": {"type": "string", "description": "n"}}
    assert out["source"] == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert out["labels"] == {"type": "object", "additionalProperties": {"type": "string"}}
