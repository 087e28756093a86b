"""OpenAPI schema of the CRDs: bounds, enums, defaults, drift against docs/engine-api.md,
the CRD documents themselves, and the samples.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from builders import experiment, pool
from crdkit import (
    CRD_FILES,
    REPO,
    admit,
    apply_defaults,
    load_crd,
    schema_errors,
    schema_of,
    unknown_fields,
)

EXP = "LoRAExperiment"

# (dotted field under the experiment, value, valid?)
EXPERIMENT_BOUNDS = [
    ("spec.lora.rank", 0, False),
    ("spec.lora.rank", 1, True),
    ("spec.lora.rank", 256, True),
    ("spec.lora.rank", 257, False),
    ("spec.lora.alpha", 0, False),
    ("spec.lora.alpha", 0.5, True),
    ("spec.lora.dropout", 0.0, True),
    ("spec.lora.dropout", 0.99, True),
    ("spec.lora.dropout", 1.0, False),
    ("spec.lora.dropout", -0.1, False),
    ("spec.lora.targetModules", [], False),
    ("spec.lora.targetModules", ["q_proj", "q_proj"], True),
    ("spec.lora.targetModules", ["q-proj"], False),
    ("spec.task.name", "summarize", False),
    ("spec.task.name", "arithmetic", True),
    ("spec.task.params", {"target": 1}, False),
    ("spec.task.params", {"target": "no"}, True),
    ("spec.task.rewardUrl", "ftp://x", False),
    ("spec.algorithm.name", "ppo", False),
    ("spec.algorithm.groupSize", 1, False),
    ("spec.algorithm.groupSize", 2, True),
    ("spec.algorithm.groupSize", 256, True),
    ("spec.algorithm.groupSize", 257, False),
    ("spec.algorithm.promptsPerStep", 0, False),
    ("spec.algorithm.promptsPerStep", 1024, True),
    ("spec.algorithm.promptsPerStep", 1025, False),
    ("spec.algorithm.learningRate", 0, False),
    ("spec.algorithm.learningRate", 1e-6, True),
    ("spec.algorithm.learningRate", "1e-4", False),
    ("spec.algorithm.klCoef", -0.01, False),
    ("spec.algorithm.klCoef", 0, True),
    ("spec.algorithm.clip", 0, False),
    ("spec.algorithm.clip", 1, True),
    ("spec.algorithm.clip", 1.01, False),
    ("spec.algorithm.maxSteps", -1, False),
    ("spec.algorithm.maxSteps", 0, True),
    ("spec.algorithm.seed", -1, False),
    ("spec.rollout.maxNewTokens", 0, False),
    ("spec.rollout.maxNewTokens", 4096, True),
    ("spec.rollout.maxNewTokens", 4097, False),
    ("spec.rollout.temperature", -0.1, False),
    ("spec.rollout.temperature", 2, True),
    ("spec.rollout.temperature", 2.01, False),
    ("spec.checkpoint.everySteps", 0, False),
    ("spec.checkpoint.everySteps", 1, True),
    ("spec.checkpoint.keep", 0, False),
    ("spec.priority", 2**31 - 1, True),
    ("spec.priority", 2**31, False),
    ("spec.priority", -(2**31), True),
    ("spec.suspend", "yes", False),
    ("spec.enginePool", "Pool_A", False),
    ("spec.enginePool", "", False),
]


def _set(obj: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    *parents, leaf = dotted.split(".")
    node = obj
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return obj


@pytest.mark.parametrize(("field", "value", "valid"), EXPERIMENT_BOUNDS, ids=lambda v: str(v)[:30])
def test_experiment_bounds(field: str, value: Any, valid: bool) -> None:
    obj = _set(experiment("a").obj(), field, value)
    errors = admit(EXP, obj)
    assert (errors == []) is valid, errors
    if not valid:
        assert any(field.split(".", 1)[1] in e or field.rsplit(".", 1)[1] in e for e in errors), (
            errors
        )


def test_experiment_requires_pool_and_task() -> None:
    obj = experiment("a").obj()
    del obj["spec"]["enginePool"], obj["spec"]["task"]
    errors = admit(EXP, obj)
    assert any("'enginePool' is a required property" in e for e in errors)
    assert any("'task' is a required property" in e for e in errors)


def test_experiment_defaults() -> None:
    spec = apply_defaults(schema_of(EXP), experiment("a").obj())["spec"]
    assert spec["lora"] == {
        "rank": 8,
        "alpha": 16,
        "dropout": 0.0,
        "targetModules": ["q_proj", "v_proj"],
    }
    assert spec["algorithm"] == {
        "name": "grpo", "groupSize": 8, "promptsPerStep": 4, "learningRate": 0.0005,
        "klCoef": 0.0, "clip": 0.2, "maxSteps": 50, "seed": 0,
    }  # fmt: skip
    assert spec["rollout"] == {"maxNewTokens": 64, "temperature": 1.0}
    assert spec["checkpoint"] == {"everySteps": 10, "keep": 3}
    assert (spec["priority"], spec["suspend"]) == (0, False)
    assert "reward" not in spec["task"]  # absent = the task's default reward, chosen by the engine


def test_defaults_fill_only_missing_fields() -> None:
    spec = apply_defaults(schema_of(EXP), experiment("a").rank(32).obj())["spec"]
    assert spec["lora"]["rank"] == 32 and spec["lora"]["alpha"] == 16


def test_pool_defaults() -> None:
    spec = apply_defaults(schema_of("EnginePool"), pool().obj())["spec"]
    assert spec["capacity"] == {"maxAdapters": 8, "maxRank": 64, "memoryBytes": 0}
    assert spec["replicas"] == {"min": 0, "max": 1}
    assert spec["rolloutBackend"] == "torch" and spec["engineNamespace"] == "loraplex-system"
    assert spec["checkpoint"] == {"root": "/ckpt"}
    assert spec["tokenSecretRef"] == {"name": "engine-token", "key": "token"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("spec.rolloutBackend", "tgi"),
        ("spec.baseModel", "models/x"),
        ("spec.capacity.maxAdapters", 0),
        ("spec.capacity.maxRank", 257),
        ("spec.replicas.max", 0),
        ("spec.capacity.memoryBytes", -1),
        ("spec.template.imagePullPolicy", "Sometimes"),
        ("spec.allowedNamespaces", ["Team_A"]),
    ],
)
def test_pool_bounds(field: str, value: Any) -> None:
    assert admit("EnginePool", _set(pool().obj(), field, value)) != []


def test_pool_requires_image_and_token() -> None:
    obj = pool().obj()
    del obj["spec"]["template"]["image"], obj["spec"]["tokenSecretRef"]
    errors = admit("EnginePool", obj)
    assert any("'image' is a required property" in e for e in errors)
    assert any("'tokenSecretRef' is a required property" in e for e in errors)


def test_unknown_field_is_reported() -> None:
    obj = _set(experiment("a").obj(), "spec.algorithm.learningrate", 0.1)
    assert admit(EXP, obj) == ["unknown field spec.algorithm.learningrate"]


def test_pod_bits_keep_unknown_fields() -> None:
    obj = (
        pool()
        .template(resources={"limits": {"nvidia.com/gpu": 1}}, tolerations=[{"key": "gpu"}])
        .obj()
    )
    assert unknown_fields(schema_of("EnginePool"), obj) == []


# --- drift: the CRD spec mirrors docs/engine-api.md field for field ---------------------


def _doc_spec() -> dict[str, Any]:
    text = (REPO / "docs" / "engine-api.md").read_text()
    section = text.split("## Experiment spec", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block, "docs/engine-api.md lost its spec example"
    return yaml.safe_load(block.group(1))


def _paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for name, sub in schema.get("properties", {}).items():
        out.add(prefix + name)
        out |= _paths(sub, f"{prefix}{name}.")
    return out


def _value_paths(
    value: Any, prefix: str = "", stop: frozenset[str] = frozenset({"task.params"})
) -> set[str]:
    out: set[str] = set()
    for name, sub in value.items():
        out.add(prefix + name)
        if isinstance(sub, dict) and prefix + name not in stop:
            out |= _value_paths(sub, f"{prefix}{name}.", stop)
    return out


def test_spec_fields_match_engine_api_doc() -> None:
    spec_schema = schema_of(EXP)["properties"]["spec"]
    assert _paths(spec_schema) == _value_paths(_doc_spec())


def test_engine_api_doc_example_passes_the_schema() -> None:
    obj = experiment("a").obj()
    obj["spec"] = _doc_spec()
    full = apply_defaults(schema_of(EXP), obj)
    assert schema_errors(schema_of(EXP), full) == []


# --- the CRD documents -----------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(CRD_FILES))
def test_crd_document_shape(kind: str) -> None:
    crd = load_crd(kind)
    spec = crd["spec"]
    assert (
        crd["apiVersion"] == "apiextensions.k8s.io/v1" and crd["kind"] == "CustomResourceDefinition"
    )
    assert (
        crd["metadata"]["name"] == f"{spec['names']['plural']}.{spec['group']}"
        and spec["group"] == "loraplex.dev"
    )
    versions = spec["versions"]
    assert [v["name"] for v in versions] == ["v1alpha1"] and sum(
        v["storage"] for v in versions
    ) == 1
    assert versions[0]["subresources"] == {"status": {}}
    assert "loraplex" in spec["names"]["categories"]


@pytest.mark.parametrize("kind", sorted(CRD_FILES))
def test_crd_validates_as_apiextensions_v1(kind: str) -> None:
    import kubernetes_validate

    checked = kubernetes_validate.validate(load_crd(kind), K8S_VERSION, strict=True)
    assert checked == K8S_VERSION


K8S_VERSION = "1.33"


def _structural_problems(schema: dict[str, Any], path: str = "") -> list[str]:
    """The structural-schema rules the API server enforces on a CRD's openAPIV3Schema."""
    problems: list[str] = []
    t = schema.get("type")
    preserve = schema.get("x-kubernetes-preserve-unknown-fields")
    if t is None and not preserve and not schema.get("x-kubernetes-int-or-string"):
        problems.append(f"{path or '<root>'}: no type")
    if "properties" in schema and isinstance(schema.get("additionalProperties"), dict):
        problems.append(f"{path}: properties and additionalProperties together")
    if "default" in schema and (
        errs := schema_errors(
            {k: v for k, v in schema.items() if k != "default"}, schema["default"]
        )
    ):
        problems.append(f"{path}: default does not validate: {errs}")
    if schema.get("x-kubernetes-list-type") == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        required = schema["items"].get("required", [])
        if not keys or not set(keys) <= set(required):
            problems.append(f"{path}: list-type map keys must be required item fields")
    for name, sub in schema.get("properties", {}).items():
        problems += _structural_problems(sub, f"{path}.{name}")
    if "items" in schema:
        problems += _structural_problems(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        problems += _structural_problems(schema["additionalProperties"], f"{path}{{}}")
    return problems


@pytest.mark.parametrize("kind", sorted(CRD_FILES))
def test_crd_schema_is_structural(kind: str) -> None:
    schema = schema_of(kind)
    assert _structural_problems(schema) == []
    assert schema["properties"]["metadata"] == {"type": "object"}  # nothing else is allowed there


@pytest.mark.parametrize("kind", sorted(CRD_FILES))
def test_printer_columns_point_at_schema_fields(kind: str) -> None:
    version = load_crd(kind)["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    for column in version["additionalPrinterColumns"]:
        node = schema
        for step in column["jsonPath"].lstrip(".").split("."):
            node = node["properties"][step] if step != "creationTimestamp" else {"type": "string"}
        assert node["type"] in (
            column["type"],
            "string" if column["type"] == "date" else column["type"],
        )


def test_experiment_printer_columns() -> None:
    cols = load_crd(EXP)["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [c["name"] for c in cols if not c.get("priority")] == [
        "Phase",
        "Pool",
        "Engine",
        "Step",
        "Reward",
        "Age",
    ]


# --- samples ---------------------------------------------------------------------------

SAMPLES = sorted((REPO / "samples").glob("*.yaml"))


def _sample_docs() -> list[dict[str, Any]]:
    return [d for path in SAMPLES for d in yaml.safe_load_all(path.read_text()) if d]


def test_samples_exist() -> None:
    kinds = [d["kind"] for d in _sample_docs()]
    assert kinds.count("EnginePool") >= 1 and kinds.count("LoRAExperiment") >= 3


@pytest.mark.parametrize(
    "doc", _sample_docs(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}"
)
def test_sample_is_admitted(doc: dict[str, Any]) -> None:
    if doc["kind"] in CRD_FILES:
        assert admit(doc["kind"], doc) == []
    else:
        import kubernetes_validate

        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
