"""The samples work as the README's "Install on a cluster" applies them.

`kubectl apply -f samples/` takes the top-level files only (no -R), in name order, each
file's documents in order: those are the cluster samples. `samples/local/` holds the
`make demo` manifests for the local runner (pool `local`, which no cluster has).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.chart_helpers import (
    CHART,
    KUBE_VERSIONS,
    NAMESPACE,
    REPO,
    by_kind,
    component,
    operator_deployment,
    render,
)
from tests.support.crdkit import CRD_FILES, admit, apply_defaults, schema_of

SAMPLES = REPO / "samples"
CLUSTER_FILES = sorted(p for p in SAMPLES.iterdir() if p.suffix in {".yaml", ".yml", ".json"})
LOCAL_FILES = sorted((SAMPLES / "local").glob("*.yaml"))
LOCAL_POOL = "local"  # the engine `loraplex-engine run` starts (loraplex_engine.local.manifests)
# Files that name sample paths for users to run or read.
DOCS = [REPO / "README.md", REPO / "Makefile", CHART / "templates" / "NOTES.txt"]
DOCS += sorted((REPO / "docs").glob("*.md"))


def _docs(paths: list[Path]) -> list[dict[str, Any]]:
    return [d for p in paths for d in yaml.safe_load_all(p.read_text()) if d]


CLUSTER = _docs(CLUSTER_FILES)


def _id(doc: dict[str, Any]) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def test_samples_are_split_as_the_readme_says() -> None:
    assert {p.name for p in CLUSTER_FILES} == {"experiments.yaml", "pool-cpu.yaml", "pool-gpu.yaml"}
    local = {
        "demo.yaml",
        "demo-smollm2.yaml",
        "gsm8k-smoke.yaml",
        "gsm8k-smollm2.yaml",
        "gsm8k-smollm2-learn.yaml",
    }
    assert {p.name for p in LOCAL_FILES} == local


@pytest.mark.parametrize("doc", _docs(CLUSTER_FILES + LOCAL_FILES), ids=_id)
def test_sample_passes_the_schema(doc: dict[str, Any]) -> None:
    """Our kinds: the CRD's OpenAPI schema, unknown fields and CEL rules, as the API server
    would check them (crdkit); built-in kinds: the Kubernetes schema, strictly."""
    if doc["kind"] in CRD_FILES:
        assert admit(doc["kind"], doc) == []
    else:
        kubernetes_validate.validate(doc, KUBE_VERSIONS[0], strict=True)


def _defaulted(kind: str) -> list[dict[str, Any]]:
    """The cluster samples of `kind` as the API server stores them (CRD defaults applied)."""
    return [apply_defaults(schema_of(kind), d) for d in by_kind(CLUSTER, kind)]


def test_cluster_experiments_name_a_sample_pool_that_admits_them() -> None:
    pools = {p["metadata"]["name"]: p["spec"] for p in _defaulted("EnginePool")}
    experiments = _defaulted("LoRAExperiment")
    assert pools and experiments
    for exp in experiments:
        spec, ns = exp["spec"], exp["metadata"].get("namespace", "default")
        assert spec["enginePool"] in pools, f"{_id(exp)}: no pool {spec['enginePool']}"
        allowed = pools[spec["enginePool"]].get("allowedNamespaces")
        assert allowed is None or ns in allowed, f"{_id(exp)}: {ns} not in {allowed}"


def test_cluster_namespaces_are_created_before_use() -> None:
    """kubectl applies in order: a namespace must exist (or come earlier) when used."""
    known = {"default", NAMESPACE}  # NAMESPACE: `helm install --create-namespace`
    for doc in CLUSTER:
        ns = doc["metadata"].get("namespace")
        assert ns is None or ns in known, f"{_id(doc)}: namespace {ns} not created before"
        if doc["kind"] == "Namespace":
            known.add(doc["metadata"]["name"])


def _chart_token() -> tuple[str, dict[str, str]]:
    """(engine namespace, tokenSecretRef) of the Secret that the chart's defaults tell
    the operator to create (it renders none) and grant it to read."""
    docs = render()
    deployment = operator_deployment(docs)
    env = {
        e["name"]: e.get("value")
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    namespace, name = env["LORAPLEX_MANAGED_TOKEN_SECRET"].split("/")
    roles = [
        r for r in component(docs, "Role", "operator") if r["metadata"]["namespace"] == NAMESPACE
    ]
    granted = [
        rule.get("resourceNames")
        for role in roles
        for rule in role["rules"]
        if "secrets" in rule["resources"] and "get" in rule["verbs"]
    ]
    assert granted == [[name]], granted
    return namespace, {"name": name, "key": "token"}


def test_cluster_pools_use_the_charts_token_secret() -> None:
    """The Secret the chart creates is the only one the operator may read (resourceNames):
    a pool naming another one leaves its engines without a token and the operator 403s."""
    namespace, ref = _chart_token()
    for pool in _defaulted("EnginePool"):
        assert pool["spec"]["tokenSecretRef"] == ref, _id(pool)
        assert pool["spec"]["engineNamespace"] == namespace, _id(pool)


def test_the_gpu_pool_asks_for_a_gpu_per_engine_on_gpu_nodes() -> None:
    """What a GPU cluster needs of it: one nvidia.com/gpu per engine, a toleration of the
    GPU nodes' taint, a GPU node selector, vLLM rollouts; no modelShape (the engines report
    theirs), and nothing started until an experiment names it."""
    (gpu,) = [p for p in _defaulted("EnginePool") if p["spec"]["rolloutBackend"] == "vllm"]
    spec, template = gpu["spec"], gpu["spec"]["template"]
    assert template["resources"]["limits"]["nvidia.com/gpu"] == 1
    tolerations = {(t["key"], t.get("effect")) for t in template["tolerations"]}
    assert ("nvidia.com/gpu", "NoSchedule") in tolerations
    assert any(k.startswith("nvidia.com/gpu") for k in template["nodeSelector"])
    assert "modelShape" not in spec and "Qwen3-4B" in spec["baseModel"]
    assert spec["replicas"]["min"] == 0 and spec["replicas"]["max"] > 1
    mounts = {m["mountPath"] for m in template["volumeMounts"]}
    assert any(spec["baseModel"].startswith(m) for m in mounts), "the model is on a volume"


def test_local_samples_use_the_local_pool_only() -> None:
    assert {d["spec"]["enginePool"] for d in _docs(LOCAL_FILES)} == {LOCAL_POOL}
    assert LOCAL_POOL not in {
        d["spec"].get("enginePool") for d in by_kind(CLUSTER, "LoRAExperiment")
    }


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_referenced_sample_files_exist(path: Path) -> None:
    named = set(re.findall(r"samples/[\w./-]*\w\.ya?ml", path.read_text()))
    missing = sorted(n for n in named if not (REPO / n).is_file())
    assert not missing, f"{path.name} names sample files that do not exist: {missing}"
