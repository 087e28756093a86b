"""OpenAPI schema of the CRDs: bounds, enums, defaults, drift against docs/engine-api.md,
the CRD documents themselves, and the samples.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from loraplex_engine.spec.errors import SpecError
from loraplex_engine.spec.experiment import ExperimentSpec, parse_spec
from loraplex_operator.status import CONDITION_TYPES

from tests.support.builders import experiment, pool
from tests.support.crdkit import (
    CRD_FILES,
    REPO,
    admit,
    apply_defaults,
    broken_rules,
    constraint_rules,
    load_crd,
    schema_errors,
    schema_of,
    unknown_fields,
)

EXP = "LoRAExperiment"
POOL = "EnginePool"
DELETE = object()  # a table value that removes the field (for `required` rules)


def _dataset_task(options: dict[str, Any]) -> dict[str, Any]:
    return {"name": "dataset", "dataset": "s3://datasets/team-a/x", "datasetOptions": options}


_SECRET = {"name": "datasets-s3"}
_OBJECT_STORES: list[tuple[dict[str, Any], bool]] = [
    ({"secretRef": _SECRET, "endpointUrl": "http://minio.storage:9000", "region": "eu-1"}, True),
    ({"secretRef": {}}, False),
    ({"secretRef": {"name": ""}}, False),
    ({"secretRef": {"name": "x" * 254}}, False),
    *(
        ({"secretRef": {**_SECRET, key: value}}, False)
        for key in ("accessKeyIdKey", "secretAccessKeyKey", "sessionTokenKey")
        for value in ("", "a b", "k" * 254)
    ),
    ({"endpointUrl": "minio:9000"}, False),
    ({"endpointUrl": "http://" + "m" * 510}, False),
    ({"region": ""}, False),
    ({"region": "EU West"}, False),
    ({"region": "r" * 65}, False),
]


def _long(n: int, head: str = "") -> str:
    """A string one character longer than `n` (a maxLength of `n` rejects it)."""
    return head + "a" * (n + 1 - len(head))


# A status.versions entry with every field at its bound (what the operator may write).
_VERSION_FULL = {
    "version": "v1",
    "evalStep": 0,
    "gateNote": _long(255),
    "requestToken": "release-7",
    "scores": {f"s{i}": 1.0 for i in range(8)},
}

# task.datasetOptions and eval.datasetOptions (one model at two paths): each rule's cases.
_DATASET_OPTIONS: list[tuple[dict[str, Any], bool]] = [
    ({"format": "parquet", "columns": {"prompt": "q", "answer": "a"}}, True),
    ({"format": "hf-disk", "split": "test"}, True),
    ({"format": "csv"}, False),
    ({"split": ""}, False),
    ({"split": "../train"}, False),
    ({"split": _long(128)}, False),
    ({"columns": {"prompt": ""}}, False),
    ({"columns": {"prompt": "a\nb"}}, False),
    ({"columns": {"prompt": _long(256)}}, False),
    ({"columns": {"answer": ""}}, False),
    ({"columns": {"answer": "a\x00"}}, False),
    ({"columns": {"answer": _long(256)}}, False),
]


def _many(n: int, item: Any = None) -> list[Any]:
    """n + 1 distinct items (a maxItems of `n` rejects them; set/map lists stay valid)."""
    return [item(i) if callable(item) else f"m{i}" for i in range(n + 1)]


def _env(**fields: Any) -> dict[str, Any]:
    """A task.environment block with `fields` over a valid one."""
    return {"name": "gsm8k_multi_turn", **fields}


_CONDITION = {
    "type": "Ready",
    "status": "True",
    "lastTransitionTime": "2030-01-01T00:00:00Z",
    "reason": "Ok",
    "message": "",
}


def _condition(**fields: Any) -> list[dict[str, Any]]:
    """A one-condition list; a field given as DELETE is left out."""
    cond = {**_CONDITION, **fields}
    return [{k: v for k, v in cond.items() if v is not DELETE}]


def _condition_cases() -> list[tuple[str, Any, bool]]:
    """status.conditions rules (metav1.Condition), the same in both CRDs (one model:
    loraplex_operator/api/condition.py)."""
    at = "status.conditions"
    cases = [
        (at, _condition(), True),
        (at, _many(16, lambda i: {**_CONDITION, "type": f"T{i}"}), False),
        (at, _condition(type=_long(316)), False),
        (at, _condition(status="Maybe"), False),
        (at, _condition(observedGeneration=-1), False),
        (at, _condition(reason=""), False),
        (at, _condition(reason="1Bad"), False),
        (at, _condition(reason=_long(1024)), False),
        (at, _condition(message=_long(32768)), False),
    ]
    cases += [(at, _condition(**{k: DELETE}), False) for k in _CONDITION]
    return [*cases, (at, _condition(type="-Ready"), False), (at, _condition(type="a/B"), True)]


# (dotted field, value, valid?). test_every_schema_rule_has_an_invalid_case holds each
# table to every minimum/maximum/enum/pattern/length/items/properties/required rule of
# its CRD; CEL rules are test_crd_rules.py's.
EXPERIMENT_BOUNDS = [
    ("spec", DELETE, False),
    ("spec.enginePool", DELETE, False),
    ("spec.task", DELETE, False),
    ("spec.lora.rank", 0, False),
    ("spec.lora.rank", 1, True),
    ("spec.lora.rank", 256, True),
    ("spec.lora.rank", 257, False),
    ("spec.lora.alpha", 0, False),
    ("spec.lora.alpha", 0.5, True),
    ("spec.lora.alpha", 4096.5, False),
    ("spec.lora.dropout", 0.0, True),
    ("spec.lora.dropout", 0.99, True),
    ("spec.lora.dropout", 1.0, False),
    ("spec.lora.dropout", -0.1, False),
    ("spec.lora.targetModules", [], False),
    ("spec.lora.targetModules", ["q_proj", "q_proj"], False),  # list-type set
    ("spec.lora.targetModules", ["q-proj"], False),
    ("spec.lora.targetModules", [""], False),
    ("spec.lora.targetModules", [_long(63)], False),
    ("spec.lora.targetModules", _many(32)[:32], True),
    ("spec.lora.targetModules", _many(32), False),
    ("spec.task.name", DELETE, False),
    ("spec.task.name", "summarize", False),
    ("spec.task.name", "arithmetic", True),
    ("spec.task.params", {"target": 1}, False),
    ("spec.task.params", {"target": "no"}, True),
    ("spec.task.params", {f"k{i}": "v" for i in range(65)}, False),
    ("spec.task.params", {"target": _long(4096)}, False),
    ("spec.task.dataset", "", False),
    *(("spec.task", _dataset_task(options), valid) for options, valid in _DATASET_OPTIONS),
    # spec.client.* on a client experiment (_case): what the gateway writes.
    ("spec.client.modelId", DELETE, False),
    ("spec.client.modelId", "", False),
    ("spec.client.modelId", "s1:sample:0", False),
    ("spec.client.modelId", "s1:train:3", True),
    ("spec.client.modelId", "a" * 64 + ":train:" + "1" * 9, True),
    ("spec.client.modelId", "a" * 64 + ":train:" + "1" * 10, False),
    ("spec.client.idleSeconds", -1, False),
    ("spec.client.idleSeconds", 0, True),
    ("spec.client.idleSeconds", 2592001, False),
    ("spec.task.dataset", _long(4096), False),
    ("spec.task.reward", "bleu", True),  # a plug-in's name: the engine refuses unknown ones
    ("spec.task.reward", "exact-match", True),
    ("spec.task.reward", "", False),
    ("spec.task.reward", "-dash-first", False),
    ("spec.task.reward", "a" * 129, False),
    ("spec.task.environment", {"params": {}}, False),
    ("spec.task.environment", _env(name=""), False),
    ("spec.task.environment", _env(name="gsm8k multi"), False),
    ("spec.task.environment", _env(name="a" * 129), False),
    ("spec.task.environment", _env(name="acme.calc:v1/x_y-z"), True),
    ("spec.task.environment", _env(params={f"k{i}": "v" for i in range(65)}), False),
    ("spec.task.environment", _env(params={"k": "v" * 4097}), False),
    ("spec.task.environment", _env(maxTurns=0), False),
    ("spec.task.environment", _env(maxTurns=64), True),
    ("spec.task.environment", _env(maxTurns=65), False),
    ("spec.task.environment", _env(maxEpisodeTokens=0), False),
    ("spec.task.environment", _env(maxEpisodeTokens=32768), True),
    ("spec.task.environment", _env(maxEpisodeTokens=32769), False),
    ("spec.task.environment", _env(observationFormat="chat"), True),
    ("spec.task.environment", _env(observationFormat="markdown"), False),
    ("spec.task.rewardUrl", "ftp://x", False),
    ("spec.task.rewardUrl", _long(2048, "http://"), False),
    ("spec.algorithm.name", "ppo", False),
    ("spec.algorithm.maxStaleness", -1, False),
    ("spec.algorithm.maxStaleness", 16, True),
    ("spec.algorithm.maxStaleness", 17, False),
    ("spec.algorithm.groupSize", 1, False),
    ("spec.algorithm.groupSize", 2, True),
    ("spec.algorithm.groupSize", 256, True),
    ("spec.algorithm.groupSize", 257, False),
    ("spec.algorithm.promptsPerStep", 0, False),
    ("spec.algorithm.promptsPerStep", 1024, True),
    ("spec.algorithm.promptsPerStep", 1025, False),
    ("spec.algorithm.learningRate", 0, False),
    ("spec.algorithm.learningRate", 1e-6, True),
    ("spec.algorithm.learningRate", 1, True),
    ("spec.algorithm.learningRate", 1.5, False),
    ("spec.algorithm.learningRate", "1e-4", False),
    ("spec.algorithm.lrSchedule", "cosine", True),
    ("spec.algorithm.lrSchedule", "linear", False),
    ("spec.algorithm.warmupSteps", -1, False),
    ("spec.algorithm.warmupSteps", 0, True),
    ("spec.algorithm.maxGradNorm", 0, False),
    ("spec.algorithm.maxGradNorm", 1e-3, True),
    ("spec.algorithm.maxGradNorm", "1.0", False),
    ("spec.algorithm.klCoef", -0.01, False),
    ("spec.algorithm.klCoef", 0, True),
    ("spec.algorithm.clip", 0, False),
    ("spec.algorithm.clip", 1, True),
    ("spec.algorithm.clip", 1.01, False),
    ("spec.algorithm.offPolicyCorrection", "tis", True),
    ("spec.algorithm.offPolicyCorrection", "none", True),
    ("spec.algorithm.offPolicyCorrection", "is", False),
    ("spec.algorithm.tisCap", 0.99, False),
    ("spec.algorithm.tisCap", 1, True),
    ("spec.algorithm.tisCap", 100, True),
    ("spec.algorithm.tisCap", 100.5, False),
    ("spec.algorithm.clipHigh", 0, False),
    ("spec.algorithm.clipHigh", 0.28, True),
    ("spec.algorithm.clipHigh", 1, True),
    ("spec.algorithm.clipHigh", 1.28, False),  # ε, not 1 + ε
    ("spec.algorithm.clipHigh", "0.28", False),
    ("spec.algorithm.importanceSamplingLevel", "sequence", True),
    ("spec.algorithm.importanceSamplingLevel", "token", True),
    ("spec.algorithm.importanceSamplingLevel", "sequence_token", False),
    ("spec.algorithm.advantageEstimator", "rloo", True),
    ("spec.algorithm.advantageEstimator", "gae", False),
    ("spec.algorithm.scaleRewards", "none", True),
    ("spec.algorithm.scaleRewards", "batch", True),
    ("spec.algorithm.scaleRewards", False, False),
    ("spec.algorithm.lossAggregation", "token-mean", True),
    ("spec.algorithm.lossAggregation", "seq-mean-token-sum-norm", True),
    ("spec.algorithm.lossAggregation", "dr_grpo", False),
    ("spec.algorithm.klEstimator", "k1", True),
    ("spec.algorithm.klEstimator", "k2", False),
    ("spec.algorithm.dynamicSampling", True, True),
    ("spec.algorithm.dynamicSampling", "true", False),
    ("spec.algorithm.overlong", {"bufferTokens": 64}, True),
    ("spec.algorithm.overlong", {}, False),  # bufferTokens is required
    ("spec.algorithm.overlong.bufferTokens", 0, False),
    ("spec.algorithm.overlong.bufferTokens", 4097, False),
    ("spec.algorithm.overlong.bufferTokens", 4.5, False),
    ("spec.algorithm.overlong", {"bufferTokens": 4, "penalty": 0}, False),
    ("spec.algorithm.overlong", {"bufferTokens": 4, "penalty": 10}, True),
    ("spec.algorithm.overlong", {"bufferTokens": 4, "penalty": 10.5}, False),
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
    ("spec.checkpoint.keep", 1000, True),
    ("spec.tracking.runName", "lr-3e-4,seed=1", True),
    ("spec.tracking.runName", "", False),
    ("spec.tracking.runName", "a/b", False),
    ("spec.tracking.runName", _long(128), False),
    ("spec.tracking.tags", [{"name": "sweep", "value": "lr été"}], True),
    ("spec.tracking.tags", [{"name": f"t{i}"} for i in range(33)], False),
    ("spec.tracking.tags", [{"value": "x"}], False),
    ("spec.tracking.tags", [{"name": "mlflow.parentRunId", "value": "x"}], False),
    ("spec.tracking.tags", [{"name": ""}], False),
    ("spec.tracking.tags", [{"name": _long(63)}], False),
    ("spec.tracking.tags", [{"name": "a", "value": "line\nbreak"}], False),
    ("spec.tracking.tags", [{"name": "a", "value": _long(257)}], False),
    ("spec.tracking.tags", [{"name": "a"}, {"name": "a"}], False),
    # spec.eval (spec/eval.py): its bounds keep a tenant's eval small.
    ("spec.eval", {}, True),
    ("spec.eval.everySteps", 0, False),
    ("spec.eval.everySteps", 1_000_000, True),
    ("spec.eval.everySteps", 1_000_001, False),
    ("spec.eval.prompts", 0, False),
    ("spec.eval.prompts", 64, True),
    ("spec.eval.prompts", 65, False),
    ("spec.eval.dataset", "", False),
    ("spec.eval.dataset", _long(4097), False),
    ("spec.eval.dataset", "held-out.jsonl", True),
    # eval.datasetOptions: task.datasetOptions' model, so the same rules at a second path.
    *(("spec.eval.datasetOptions", options, valid) for options, valid in _DATASET_OPTIONS),
    ("spec.eval", {"samples": 0}, False),
    ("spec.eval", {"samples": 16, "temperature": 1.0}, True),
    ("spec.eval", {"samples": 17, "temperature": 1.0}, False),
    ("spec.eval", {"passAtK": 0}, False),
    ("spec.eval", {"passAtK": 17, "samples": 16, "temperature": 1.0}, False),
    ("spec.eval.temperature", -0.1, False),
    ("spec.eval.temperature", 2.01, False),
    ("spec.eval.passThreshold", -1e9, True),
    ("spec.eval.passThreshold", -1.1e9, False),
    ("spec.eval.passThreshold", 1.1e9, False),
    ("spec.checkpoint.keep", 1001, False),
    ("spec.publish.everySteps", 0, False),
    ("spec.publish.everySteps", 1, True),
    ("spec.publish.keep", 0, False),
    ("spec.publish.keep", 1000, True),
    ("spec.publish.keep", 1001, False),
    ("spec.publish.pinned", ["v1", "v999999999"], True),
    ("spec.publish.pinned", [f"v{i + 1}" for i in range(65)], False),
    ("spec.publish.pinned", ["v0"], False),
    ("spec.publish.pinned", ["v1234567890"], False),  # pattern and maxLength
    ("spec.publish.aliases", [{"name": "stable", "version": "v2"}], True),
    ("spec.publish.aliases", [{"name": f"a{i}", "version": "v1"} for i in range(33)], False),
    ("spec.publish.aliases", [{"version": "v1"}], False),
    ("spec.publish.aliases", [{"name": "stable"}], False),
    ("spec.publish.aliases", [{"name": "Stable", "version": "v1"}], False),
    ("spec.publish.aliases", [{"name": "", "version": "v1"}], False),
    ("spec.publish.aliases", [{"name": "a" * 33, "version": "v1"}], False),
    ("spec.publish.aliases", [{"name": "a", "version": "v1234567890"}], False),
    ("spec.publish.promoteWhen", {"score": "meanReward"}, False),
    ("spec.publish.promoteWhen", {"score": "bleu", "atLeast": 0.5}, False),
    ("spec.publish.promoteWhen", {"atLeast": -1e10}, False),
    ("spec.publish.promoteWhen", {"atLeast": 1e10}, False),
    ("spec.publish.promoteWhen", {"atLeast": 0.5}, True),
    # an eval score needs spec.eval (the base has none: its spec-level rule)
    ("spec.publish.promoteWhen", {"score": "evalReward", "atLeast": 0.5}, False),
    ("spec.publish.onEvalImprovement", "evalReward", False),
    ("spec.publish.onEvalImprovement", "meanReward", False),  # not an eval score
    ("spec.publish.requestToken", "release-7.1_b", True),
    ("spec.publish.requestToken", "", False),
    ("spec.publish.requestToken", _long(63), False),
    ("spec.publish.requestToken", "a b", False),
    ("spec.publish.requestToken", "-a", False),
    ("spec.priority", 0, True),  # the retired field: anything else is its CEL rule's
    ("spec.priority", "1", False),
    ("spec.priorityClassName", "high-1", True),
    ("spec.priorityClassName", "", False),
    ("spec.priorityClassName", "High", False),
    ("spec.priorityClassName", "team.high", False),  # a DNS label, as the pool's class names
    ("spec.priorityClassName", _long(63), False),
    ("spec.suspend", "yes", False),
    ("spec.enginePool", "Pool_A", False),
    ("spec.enginePool", "", False),
    ("spec.enginePool", _long(253), False),
    ("status.phase", "Done", False),
    ("status.phase", "Succeeded", True),
    ("status.restarts", -1, False),
    ("status.versions", [{"version": "v1", "step": 3, "gatePassed": True}], True),
    ("status.versions", [{"version": f"v{i + 1}"} for i in range(11)], False),
    ("status.versions", [{"step": 3}], False),
    ("status.versions", [{"version": "3"}], False),
    ("status.versions", [_VERSION_FULL], True),
    ("status.versions", [{"version": "v1", "evalStep": -1}], False),
    ("status.versions", [{"version": "v1", "gateNote": _long(256)}], False),
    ("status.versions", [{"version": "v1", "requestToken": "a b"}], False),
    ("status.versions", [{"version": "v1", "requestToken": _long(63)}], False),
    ("status.versions", [{"version": "v1", "scores": {f"s{i}": 1.0 for i in range(9)}}], False),
    ("status.publishRequestToken", "release-7", True),
    ("status.publishRequestToken", "-a", False),
    ("status.publishRequestToken", _long(63), False),
    ("status.aliases", {"stable": "v2", "latest": "v3"}, True),
    ("status.aliases", {f"a{i}": "v1" for i in range(41)}, False),
    *_condition_cases(),
]

_URI = "http://mlflow.mlops.svc:5000"
_MLFLOW = {"trackingUri": _URI}
# EnginePool spec.tracking (api/pool_tracking.py): each whole, so a case breaks one rule.
TRACKING_CASES: list[tuple[Any, bool]] = [
    ({"mlflow": _MLFLOW, "wandb": {}, "tensorboard": {"logDir": "/tb"}, "queue": 1}, True),
    ({"mlflow": {}}, False),
    ({"mlflow": {"trackingUri": "ftp://mlflow"}}, False),
    ({"mlflow": {"trackingUri": "http://"}}, False),
    ({"mlflow": {"trackingUri": _long(2048, "http://")}}, False),
    ({"mlflow": _MLFLOW | {"experimentPrefix": "team/rl"}}, True),
    ({"mlflow": _MLFLOW | {"experimentPrefix": ""}}, False),
    ({"mlflow": _MLFLOW | {"experimentPrefix": "-x"}}, False),
    ({"mlflow": _MLFLOW | {"experimentPrefix": _long(128)}}, False),
    ({"wandb": {"mode": "online", "project": "p.x", "entity": "team-a", "dir": "/w"}}, True),
    ({"wandb": {"mode": "disabled"}}, False),
    ({"wandb": {"project": ""}}, False),
    ({"wandb": {"project": "a b"}}, False),
    ({"wandb": {"project": _long(128)}}, False),
    ({"wandb": {"entity": ""}}, False),
    ({"wandb": {"entity": "a/b"}}, False),
    ({"wandb": {"entity": _long(128)}}, False),
    ({"wandb": {"dir": "/"}}, False),
    ({"wandb": {"dir": "rel/ative"}}, False),
    ({"wandb": {"dir": _long(4096, "/")}}, False),
    ({"tensorboard": {}}, False),
    ({"tensorboard": {"logDir": "/"}}, False),
    ({"tensorboard": {"logDir": "tb"}}, False),
    ({"tensorboard": {"logDir": _long(4096, "/")}}, False),
    ({"queue": 0}, False),
    ({"queue": 1_000_000}, True),
    ({"queue": 1_000_001}, False),
]


def _grant_cases(block: str) -> list[tuple[str, Any, bool]]:
    """spec.plugins.allowed (api/plugins.py) and status.plugins.allowed, which repeats it."""

    def grants(*items: dict[str, Any]) -> dict[str, Any]:
        return {"allowed": list(items)}

    full = {"namespaces": ["team-a"], "rewards": ["acme"], "environments": ["verifiers:x"]}
    cases: list[tuple[str, Any, bool]] = [
        (block, grants(full), True),
        (block, grants({"environments": ["gsm8k-calculator"]}), True),  # every namespace
        (block, grants({"namespaces": []}), False),  # absent means every namespace
        (block, grants({"namespaces": _many(256)}), False),
        (block, grants({"namespaces": ["Team_A"]}), False),
        (block, grants({"namespaces": [""]}), False),
        (block, grants({"namespaces": [_long(63)]}), False),
        (block, grants({"namespaces": ["team-a", "team-a"]}), False),  # list-type set
    ]
    for kind in ("rewards", "environments"):
        cases += [
            (block, grants({kind: _many(64)}), False),
            (block, grants({kind: ["-dash-first"]}), False),
            (block, grants({kind: [""]}), False),
            (block, grants({kind: [_long(128)]}), False),
        ]
    return cases


POOL_BOUNDS = [
    ("spec", DELETE, False),
    ("spec.baseModel", DELETE, False),
    ("spec.baseModel", "models/x", False),
    ("spec.baseModel", "/", False),
    ("spec.baseModel", _long(4096, "/"), False),
    ("spec.template", DELETE, False),
    ("spec.tokenSecretRef", DELETE, False),
    ("spec.rolloutBackend", "tgi", False),
    ("spec.rolloutBackend", "vllm", True),
    ("spec.dtype", "fp8", False),
    ("spec.dtype", "bfloat16", True),
    ("spec.gradientCheckpointing", "yes", False),
    ("spec.gradientCheckpointing", False, True),
    ("spec.gpusPerEngine", 0, False),
    ("spec.gpusPerEngine", 8, True),
    ("spec.gpusPerEngine", 9, False),
    ("spec.gpusPerEngine", "2", False),
    ("spec.shardBase", "true", False),
    ("spec.shardBase", False, True),
    ("spec.template.shmSize", "1Gi", True),
    ("spec.template.shmSize", "1.5G", True),
    ("spec.template.shmSize", "1 GiB", False),
    ("spec.template.shmSize", "-1Gi", False),
    ("spec.template.shmSize", "1" * 33, False),
    ("spec.vllm.device", "gpu1", False),
    ("spec.vllm.device", "cuda:1", True),
    ("spec.vllm.gpuMemoryUtilization", 0, False),
    ("spec.vllm.gpuMemoryUtilization", 1.5, False),
    ("spec.vllm.gpuMemoryUtilization", 0.4, True),
    ("spec.vllm.sleepMode", False, True),
    ("spec.capacity.microBatchTokens", 0, False),
    ("spec.capacity.microBatchTokens", 1, True),
    ("spec.capacity.microBatchTokens", "4096", False),
    ("spec.capacity.rolloutKvTokens", 0, False),
    ("spec.capacity.rolloutKvTokens", 2**40, True),
    ("spec.capacity.rolloutKvTokens", 1.5, False),
    ("spec.queueName", "", False),
    ("spec.queueName", _long(64), False),
    ("spec.queueName", "Team_Queue", False),
    ("spec.queueName", "team-a.gpu-queue", True),
    ("spec.engineNamespace", "Team_A", False),
    ("spec.engineNamespace", "", False),
    ("spec.engineNamespace", _long(63), False),
    ("spec.checkpoint.quotaBytesPerNamespace", 0, False),
    ("spec.checkpoint.quotaBytesPerNamespace", 1, True),
    ("spec.checkpoint.keepRuns", 0, False),
    ("spec.checkpoint.keepRuns", 1, True),
    ("spec.checkpoint.keepRuns", 1001, False),
    *[("spec.tracking", t, ok) for t, ok in TRACKING_CASES],
    ("spec.allowDatasetHardLinks", "yes", False),
    *(
        ("spec.objectStore", {"prefixes": ["s3://datasets/{namespace}/"], **store}, valid)
        for store, valid in _OBJECT_STORES
    ),
    ("spec.objectStore", {"endpointUrl": "http://minio:9000"}, False),  # no prefixes
    ("spec.objectStore", {"prefixes": []}, False),
    ("spec.objectStore", {"prefixes": _many(16, lambda i: f"s3://b{i:02}/{{namespace}}/")}, False),
    ("spec.objectStore", {"prefixes": ["s3://datasets/teams/"]}, False),  # no {namespace}
    ("spec.objectStore", {"prefixes": ["s3://a/"]}, False),  # too short
    ("spec.objectStore", {"prefixes": [f"s3://data/{{namespace}}/{'a' * 500}/"]}, False),
    ("spec.allowDatasetHardLinks", True, True),
    ("spec.capacity.maxAdapters", 0, False),
    ("spec.capacity.maxAdapters", 256, True),
    ("spec.capacity.maxAdapters", 257, False),
    ("spec.capacity.maxRank", 0, False),
    ("spec.capacity.maxRank", 257, False),
    ("spec.capacity.memoryBytes", -1, False),
    ("spec.capacity.memoryBytes", 0, True),
    ("spec.capacity.microBatchTokens", 0, False),
    ("spec.capacity.microBatchTokens", 1048577, False),
    ("spec.capacity.microBatchTokens", 8192, True),
    ("spec.capacity.deviceMemoryBytes", 0, False),
    ("spec.capacity.deviceMemoryBytes", 80 * 2**30, True),
    ("spec.capacity.maxRegistered", 0, False),
    ("spec.capacity.maxRegistered", 512, True),
    ("spec.capacity.hostAdapterMemoryBytes", 0, False),
    ("spec.capacity.hostAdapterMemoryBytes", 8 * 2**30, True),
    ("spec.servedModelNames", ["Qwen/Qwen3-8B", "qwen3"], True),
    ("spec.servedModelNames", [f"name-{i}" for i in range(17)], False),  # maxItems
    ("spec.servedModelNames", ["a" * 194], False),  # maxLength (and pattern)
    ("spec.servedModelNames", ["Qwen/Qwen3-8B:latest"], False),  # pattern: no tag
    ("spec.modelShape.numLayers", DELETE, False),
    ("spec.modelShape.hiddenSize", DELETE, False),
    ("spec.modelShape.numLayers", 0, False),
    ("spec.modelShape.numLayers", 1025, False),
    ("spec.modelShape.hiddenSize", 0, False),
    ("spec.modelShape.hiddenSize", 1048577, False),
    ("spec.modelShape.intermediateSize", 0, False),
    ("spec.modelShape.intermediateSize", 4194305, False),
    ("spec.modelShape.kvDim", 0, False),
    ("spec.modelShape.kvDim", 1048577, False),
    ("spec.allowedTargetModules", _many(64), False),
    ("spec.allowedTargetModules", [""], False),
    ("spec.allowedTargetModules", [_long(63)], False),
    ("spec.replicas.min", -1, False),
    ("spec.replicas.min", 1001, False),
    ("spec.replicas.max", 0, False),
    ("spec.replicas.max", 1001, False),
    ("spec.template.image", DELETE, False),
    ("spec.template.image", "", False),
    ("spec.template.image", _long(1024), False),
    ("spec.template.imagePullPolicy", "Sometimes", False),
    ("spec.template.imagePullPolicy", "Never", True),
    ("spec.template.logFormat", "xml", False),
    ("spec.template.logFormat", "json", True),
    ("spec.template.imagePullSecrets", _many(16, lambda i: {"name": f"s{i}"}), False),
    ("spec.template.imagePullSecrets", [{}], False),
    ("spec.template.serviceAccountName", _long(253), False),
    ("spec.template.priorityClassName", _long(253), False),
    ("spec.template.tolerations", _many(64, lambda i: {"key": f"k{i}"}), False),
    ("spec.template.volumes", _many(64, lambda i: {"name": f"v{i}"}), False),
    ("spec.template.volumes", [{"emptyDir": {}}], False),
    ("spec.template.volumes", [{"name": ""}], False),
    ("spec.template.volumes", [{"name": _long(63)}], False),
    ("spec.template.volumeMounts", _many(64, lambda i: {"name": "v", "mountPath": "/x"}), False),
    ("spec.template.volumeMounts", [{"mountPath": "/x"}], False),
    ("spec.template.volumeMounts", [{"name": "v"}], False),
    ("spec.template.volumeMounts", [{"name": "", "mountPath": "/x"}], False),
    ("spec.template.volumeMounts", [{"name": _long(63), "mountPath": "/x"}], False),
    ("spec.template.volumeMounts", [{"name": "v", "mountPath": ""}], False),
    ("spec.template.volumeMounts", [{"name": "v", "mountPath": _long(4096)}], False),
    ("spec.template.env", _many(256, lambda i: {"name": f"E{i}"}), False),
    ("spec.template.env", [{"value": "1"}], False),
    ("spec.template.env", [{"name": "A", "value": "1"}, {"name": "A"}], False),  # map key
    ("spec.template.env", [{"name": ""}], False),
    ("spec.template.env", [{"name": _long(256)}], False),
    ("spec.template.extraArgs", _many(64), False),
    ("spec.template.extraArgs", [_long(1024)], False),
    ("spec.checkpoint.root", "ckpt", False),
    ("spec.checkpoint.root", "/", False),
    ("spec.checkpoint.root", _long(4096, "/"), False),
    ("spec.dataRoots", ["/data", "/more"], True),
    ("spec.dataRoots", ["data"], False),  # absolute only
    ("spec.dataRoots", ["/"], False),
    ("spec.dataRoots", ["/data", "/data"], False),  # list-type set
    ("spec.dataRoots", _many(16, lambda i: f"/d{i}"), False),
    ("spec.dataRoots", [_long(4096, "/")], False),
    ("spec.rewardHosts", ["127.0.0.1", "rewards.team-a.svc", "::1"], True),
    ("spec.rewardHosts", ["rewards --insecure-no-auth"], False),  # no spaces: one value
    ("spec.rewardHosts", ["h", "h"], False),
    ("spec.rewardHosts", _many(64), False),
    ("spec.rewardHosts", [""], False),
    ("spec.rewardHosts", [_long(253)], False),
    ("spec.priorityClasses", [{"name": "high", "value": 10}], True),
    ("spec.priorityClasses", _many(64, lambda i: {"name": f"c{i}", "value": i}), False),
    ("spec.priorityClasses", [{"name": "a", "value": 1}, {"name": "a", "value": 2}], False),  # map
    ("spec.priorityClasses", [{"value": 1}], False),
    ("spec.priorityClasses", [{"name": "a"}], False),
    ("spec.priorityClasses", [{"name": "", "value": 1}], False),
    ("spec.priorityClasses", [{"name": "High", "value": 1}], False),
    ("spec.priorityClasses", [{"name": _long(63), "value": 1}], False),
    ("spec.priorityClasses", [{"name": "a", "value": 10**9}], True),
    ("spec.priorityClasses", [{"name": "a", "value": -(10**9)}], True),
    ("spec.priorityClasses", [{"name": "a", "value": 10**9 + 1}], False),
    ("spec.priorityClasses", [{"name": "a", "value": -(10**9) - 1}], False),
    ("spec.priorityClasses", [{"name": "a", "value": 1, "namespaces": ["team-a"]}], True),
    ("spec.priorityClasses", [{"name": "a", "value": 1, "namespaces": []}], False),
    ("spec.priorityClasses", [{"name": "a", "value": 1, "namespaces": ["t", "t"]}], False),
    ("spec.priorityClasses", [{"name": "a", "value": 1, "namespaces": _many(1024)}], False),
    ("spec.priorityClasses", [{"name": "a", "value": 1, "namespaces": ["Team_A"]}], False),
    ("spec.priorityClasses", [{"name": "a", "value": 1, "namespaces": [""]}], False),
    ("spec.priorityClasses", [{"name": "a", "value": 1, "namespaces": [_long(63)]}], False),
    ("spec.priorityClasses", [{"name": "a", "value": 1, "preemptOtherNamespaces": "y"}], False),
    ("spec.plugins", {"allowed": []}, True),  # none may name any plug-in
    ("spec.plugins", {"allowed": _many(64, lambda i: {"rewards": [f"r{i}"]})}, False),
    *_grant_cases("spec.plugins"),
    *_grant_cases("status.plugins"),
    ("spec.allowedNamespaces", ["Team_A"], False),
    ("spec.allowedNamespaces", ["team-a"], True),
    ("spec.allowedNamespaces", ["team-a", "team-a"], False),  # list-type set
    ("spec.allowedNamespaces", _many(1024), False),
    ("spec.allowedNamespaces", [""], False),
    ("spec.allowedNamespaces", [_long(63)], False),
    ("spec.namespaceSelector.matchExpressions", [{"operator": "Exists"}], False),
    ("spec.namespaceSelector.matchExpressions", [{"key": "team"}], False),
    ("spec.namespaceSelector.matchExpressions", [{"key": "team", "operator": "Like"}], False),
    ("spec.namespaceSelector.matchExpressions", [{"key": "team", "operator": "Exists"}], True),
    ("spec.tokenSecretRef.name", DELETE, False),
    ("spec.tokenSecretRef.name", "", False),
    ("spec.tokenSecretRef.name", _long(253), False),
    ("spec.tokenSecretRef.key", "", False),
    ("spec.tokenSecretRef.key", _long(253), False),
    *[(f"status.{f}", -1, False) for f in ("engines", "ready", "slotsUsed", "slotsFree")],
    *[
        (f"status.{f}", -1, False)
        for f in (
            "registeredUsed",
            "registeredFree",
            "pagedAdapters",
            "spilledAdapters",
            "pagedHostBytes",
        )
    ],
    ("status.engines", 0, True),
    *_condition_cases(),
]

BOUNDS = {EXP: EXPERIMENT_BOUNDS, POOL: POOL_BOUNDS}


def _set(obj: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    *parents, leaf = dotted.split(".")
    node = obj
    for p in parents:
        node = node.setdefault(p, {})
    if value is DELETE:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return obj


def _case(kind: str, field: str, value: Any) -> dict[str, Any]:
    # The pool carries a modelShape so its fields can be broken one at a time (an absent
    # block has no field rules to break, and a partial one breaks `required` too).
    if kind == EXP:
        base = experiment("a").client() if field.startswith("spec.client.") else experiment("a")
    else:
        base = pool().model_shape(numLayers=2, hiddenSize=64)
    return _set(base.obj(), field, value)


def _names_field(error: str, field: str) -> bool:
    """The error is about `field`: at it or inside it, or its parent saying it is required."""
    where, _, message = error.partition(": ")
    parent, _, leaf = field.rpartition(".")
    inside = where == field or where.startswith((field + ".", field + "["))
    # A rule on the whole spec (x-kubernetes-validations on spec) answers its message
    # alone; it must name the field by its path.
    spec_rule = not message and f"{field} " in error
    required = where == parent and f"'{leaf}' is a required property" in message
    return inside or spec_rule or required


def _check_bound(kind: str, field: str, value: Any, valid: bool) -> None:
    errors = admit(kind, _case(kind, field, value))
    assert (errors == []) is valid, errors
    # Every message names the field, so a user can tell what to fix (and a case cannot
    # pass on another field's rule).
    assert all(_names_field(e, field) for e in errors), (field, errors)


def _id(v: Any) -> str:
    return "DELETE" if v is DELETE else str(v)[:30]


@pytest.mark.parametrize(("field", "value", "valid"), EXPERIMENT_BOUNDS, ids=_id)
def test_experiment_bounds(field: str, value: Any, valid: bool) -> None:
    _check_bound(EXP, field, value, valid)


@pytest.mark.parametrize(("field", "value", "valid"), POOL_BOUNDS, ids=_id)
def test_pool_bounds(field: str, value: Any, valid: bool) -> None:
    _check_bound(POOL, field, value, valid)


def _engine_admits(spec: dict[str, Any]) -> bool:
    try:
        parse_spec(spec)
    except SpecError:
        return False
    return True


# The engine validates the spec with the pydantic models the CRD's spec schema is
# generated from; here both sides judge the same values. Fields only the cluster requires
# (ExperimentSpec.CLUSTER_REQUIRED) are the one deliberate difference.
_ENGINE_CASES = [
    (field, value, valid)
    for field, value, valid in EXPERIMENT_BOUNDS
    if field.startswith("spec.")
    and not (value is DELETE and field.removeprefix("spec.") in ExperimentSpec.CLUSTER_REQUIRED)
]


@pytest.mark.parametrize(("field", "value", "valid"), _ENGINE_CASES, ids=_id)
def test_engine_agrees_with_the_schema(field: str, value: Any, valid: bool) -> None:
    assert _engine_admits(_case(EXP, field, value)["spec"]) is valid


def test_engine_does_not_require_a_pool() -> None:
    spec = _case(EXP, "spec.enginePool", DELETE)["spec"]
    assert _engine_admits(spec) and admit(EXP, _case(EXP, "spec.enginePool", DELETE)) != []


def test_the_rule_walker_sees_nested_rules() -> None:
    # Guards the completeness test below against a walker that finds too little.
    exp, pool_rules = set(constraint_rules(schema_of(EXP))), set(constraint_rules(schema_of(POOL)))
    assert {
        "<root> required:spec",
        "spec.client required:modelId",
        "spec.lora.alpha maximum",
        "spec.lora.targetModules maxItems",
        "spec.lora.targetModules[] pattern",
        "spec.task.params maxProperties",
        "spec.task.params{} maxLength",
        "spec.task.reward pattern",
        "spec.checkpoint.keep maximum",
        "status.conditions[] required:reason",
    } <= exp
    assert "spec.namespaceSelector.matchExpressions[].operator enum" in pool_rules
    assert len(exp) >= 60 and len(pool_rules) >= 90


@pytest.mark.parametrize("kind", sorted(CRD_FILES))
def test_every_schema_rule_has_an_invalid_case(kind: str) -> None:
    """A rule added to a CRD without a case in its table fails here: each rule must be
    seen rejecting a value (jsonschema reports which rule did)."""
    schema = schema_of(kind)
    broken: set[str] = set()
    for field, value, valid in BOUNDS[kind]:
        if not valid:
            broken |= broken_rules(schema, apply_defaults(schema, _case(kind, field, value)))
    assert [r for r in constraint_rules(schema) if r not in broken] == []


def test_experiment_requires_pool_and_task_or_client() -> None:
    obj = experiment("a").obj()
    del obj["spec"]["enginePool"], obj["spec"]["task"]
    assert any("'enginePool' is a required property" in e for e in admit(EXP, obj))
    obj = experiment("a").obj()
    del obj["spec"]["task"]  # the schema holds; the spec's rule refuses it
    assert [e[:31] for e in admit(EXP, obj)] == ["set exactly one of spec.task (t"]


def test_experiment_defaults() -> None:
    spec = apply_defaults(schema_of(EXP), experiment("a").obj())["spec"]
    # No targetModules default: absent = the base model family's, which the engine resolves.
    assert spec["lora"] == {"rank": 8, "alpha": 16, "dropout": 0.0}
    assert spec["algorithm"] == {
        "name": "grpo", "groupSize": 8, "promptsPerStep": 4, "learningRate": 0.0005,
        "lrSchedule": "constant", "warmupSteps": 0,
        "klCoef": 0.0, "clip": 0.2, "offPolicyCorrection": "none", "tisCap": 2.0,
        "importanceSamplingLevel": "token", "advantageEstimator": "grpo",
        "scaleRewards": "group", "lossAggregation": "seq-mean-token-mean", "klEstimator": "k3",
        "dynamicSampling": False, "maxSteps": 50, "seed": 0, "maxStaleness": 0,
    }  # fmt: skip
    assert "clipHigh" not in spec["algorithm"] and "overlong" not in spec["algorithm"]
    assert "maxGradNorm" not in spec["algorithm"]  # absent = no clipping
    assert spec["rollout"] == {"maxNewTokens": 64, "temperature": 1.0, "reproducible": False}
    assert spec["checkpoint"] == {"everySteps": 10, "keep": 3}
    assert spec["suspend"] is False
    assert "priority" not in spec and "priorityClassName" not in spec  # the default class
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
    assert (spec["gpusPerEngine"], spec["shardBase"]) == (1, False)  # one rank, base whole


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


def _doc_client_spec() -> dict[str, Any]:
    """The client experiment's example (the second block of the section)."""
    return _doc_block(1)


def _doc_environment_spec() -> dict[str, Any]:
    """The multi-turn experiment's example (the third block of the section)."""
    return _doc_block(2)


def _doc_block(index: int) -> dict[str, Any]:
    section = (REPO / "docs" / "engine-api.md").read_text().split("## Experiment spec", 1)[1]
    return yaml.safe_load(re.findall(r"```yaml\n(.*?)```", section, re.S)[index])


def test_spec_fields_match_engine_api_doc() -> None:
    spec_schema = schema_of(EXP)["properties"]["spec"]
    documented = _value_paths(_doc_spec()) | _value_paths(_doc_client_spec())
    assert _paths(spec_schema) == documented | _value_paths(_doc_environment_spec())
    assert admit(EXP, {**experiment("a").obj(), "spec": _doc_client_spec()}) == []
    assert admit(EXP, {**experiment("a").obj(), "spec": _doc_environment_spec()}) == []


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
        # A condition's field: `.status.conditions[?(@.type=="Ready")].status` reads the
        # item of a type the operator writes.
        path, types = re.subn(r'\[\?\(@\.type=="(\w+)"\)\]', "[]", column["jsonPath"])
        if types:
            written = re.findall(r'@\.type=="(\w+)"', column["jsonPath"])
            assert set(written) <= set(CONDITION_TYPES), column
        for step in path.lstrip(".").split("."):
            if step.endswith("[]"):
                node = node["properties"][step[:-2]]["items"]
                continue
            if "properties" not in node and "additionalProperties" in node:
                node = node["additionalProperties"]  # a map's key (.status.aliases.stable)
                continue
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
        "Progress",
        "Reward",
        "Stable",
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
