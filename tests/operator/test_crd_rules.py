"""One test per CEL rule (x-kubernetes-validations) in our CRDs, valid and invalid.

Every rule found by walking the schemas must have a case here, keyed by the start of its
message: a new rule without a test fails `test_every_rule_has_a_case`. Invalid objects
must break exactly that rule (and nothing else).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from builders import experiment, pool
from crdkit import admit, cel_errors, schema_of, walk_rules

Obj = dict[str, Any]


@dataclass(frozen=True)
class RuleCase:
    valid: Callable[[], Obj]
    invalid: Callable[[], Obj]
    old: Callable[[], Obj] | None = None  # transition rules: the object being updated


def _exp_name(n: int) -> Callable[[], Obj]:
    return lambda: experiment("x" * n).obj()


def _pool_name(n: int) -> Callable[[], Obj]:
    return lambda: pool("p" * n).obj()


_PVC = {"persistentVolumeClaim": {"claimName": "ckpt"}}
_MODEL_VOL = {"name": "models", "persistentVolumeClaim": {"claimName": "models"}}

EXPERIMENT_RULES: dict[str, RuleCase] = {
    "metadata.name must be at most 189": RuleCase(valid=_exp_name(189), invalid=_exp_name(190)),
    "GRPO needs rollout.temperature > 0": RuleCase(
        valid=lambda: experiment("a").rollout(temperature=0.01).obj(),
        invalid=lambda: experiment("a").rollout(temperature=0).obj(),
    ),
    "algorithm.groupSize × algorithm.promptsPerStep": RuleCase(
        valid=lambda: experiment("a").algorithm(groupSize=256, promptsPerStep=32).obj(),
        invalid=lambda: experiment("a").algorithm(groupSize=256, promptsPerStep=33).obj(),
    ),
    "enginePool is immutable": RuleCase(
        valid=lambda: experiment("a").pool("pool-a").priority(3).obj(),
        invalid=lambda: experiment("a").pool("pool-b").obj(),
        old=lambda: experiment("a").pool("pool-a").obj(),
    ),
    "lora is immutable": RuleCase(
        valid=lambda: experiment("a").rank(16).suspend().obj(),
        invalid=lambda: experiment("a").rank(32).obj(),
        old=lambda: experiment("a").rank(16).obj(),
    ),
    "lora.alpha must be at most 16 × lora.rank": RuleCase(
        valid=lambda: experiment("a").rank(1).alpha(16).obj(),
        invalid=lambda: experiment("a").rank(1).alpha(16.5).obj(),
    ),
    "task.dataset is required when task.name is jsonl": RuleCase(
        valid=lambda: experiment("a").task("jsonl", dataset="/data/train.jsonl").obj(),
        invalid=lambda: experiment("a").task("jsonl").obj(),
    ),
    "task.dataset is only used by the jsonl task": RuleCase(
        valid=lambda: experiment("a").task("copy").obj(),
        invalid=lambda: experiment("a").task("copy", dataset="/data/train.jsonl").obj(),
    ),
    "task.rewardUrl is required when task.reward is http": RuleCase(
        valid=lambda: experiment("a").reward("http", "http://rewards:8080/score").obj(),
        invalid=lambda: experiment("a").reward("http").obj(),
    ),
    "task.rewardUrl is only used when task.reward is http": RuleCase(
        valid=lambda: experiment("a").reward("exact-match").obj(),
        invalid=lambda: experiment("a").reward("exact-match", "http://rewards:8080/score").obj(),
    ),
}

POOL_RULES: dict[str, RuleCase] = {
    "metadata.name must be at most 40": RuleCase(valid=_pool_name(40), invalid=_pool_name(41)),
    "a pool of more than one engine needs checkpoint.volume": RuleCase(
        valid=lambda: pool().replicas(0, 3).checkpoint(volume=_PVC).obj(),
        invalid=lambda: pool().replicas(0, 3).obj(),
    ),
    "modelShape.kvDim must be at most modelShape.hiddenSize": RuleCase(
        valid=lambda: pool().model_shape(numLayers=2, hiddenSize=64, kvDim=64).obj(),
        invalid=lambda: pool().model_shape(numLayers=2, hiddenSize=64, kvDim=65).obj(),
    ),
    "replicas.min must be less than or equal to replicas.max": RuleCase(
        valid=lambda: pool().replicas(1, 1).obj(),
        invalid=lambda: pool().replicas(2, 1).obj(),
    ),
    "template.volumes must not use the reserved names": RuleCase(
        valid=lambda: pool().template(volumes=[_MODEL_VOL]).obj(),
        invalid=lambda: (
            pool().template(volumes=[{"name": "loraplex-checkpoints", "emptyDir": {}}]).obj()
        ),
    ),
    "every template.volumeMounts entry must name a volume": RuleCase(
        valid=lambda: (
            pool()
            .template(volumes=[_MODEL_VOL], volumeMounts=[{"name": "models", "mountPath": "/m"}])
            .obj()
        ),
        invalid=lambda: pool().template(volumeMounts=[{"name": "models", "mountPath": "/m"}]).obj(),
    ),
    "engineNamespace is immutable": RuleCase(
        valid=lambda: pool().set("spec.engineNamespace", "gpu").slots(4).obj(),
        invalid=lambda: pool().set("spec.engineNamespace", "other").obj(),
        old=lambda: pool().set("spec.engineNamespace", "gpu").obj(),
    ),
}

CASES = {"LoRAExperiment": EXPERIMENT_RULES, "EnginePool": POOL_RULES}
PARAMS = [
    pytest.param(kind, msg, case, id=f"{kind}:{msg[:50]}")
    for kind, t in CASES.items()
    for msg, case in t.items()
]


@pytest.mark.parametrize("kind", sorted(CASES))
def test_every_rule_has_a_case(kind: str) -> None:
    messages = [r.message for r in walk_rules(schema_of(kind))]
    covered = {key: [m for m in messages if m.startswith(key)] for key in CASES[kind]}
    assert all(len(found) == 1 for found in covered.values()), f"stale or ambiguous keys: {covered}"
    missing = [m for m in messages if not any(m.startswith(key) for key in CASES[kind])]
    assert missing == [], "add a RuleCase for each new rule"


@pytest.mark.parametrize(("kind", "message", "case"), PARAMS)
def test_rule_accepts_valid(kind: str, message: str, case: RuleCase) -> None:
    old = case.old() if case.old else None
    assert admit(kind, case.valid(), old) == []


@pytest.mark.parametrize(("kind", "message", "case"), PARAMS)
def test_rule_rejects_invalid(kind: str, message: str, case: RuleCase) -> None:
    old = case.old() if case.old else None
    errors = admit(kind, case.invalid(), old)
    assert len(errors) == 1 and errors[0].startswith(message), errors


@pytest.mark.parametrize(("kind", "message", "case"), [p for p in PARAMS if p.values[2].old])
def test_transition_rule_skipped_on_create(kind: str, message: str, case: RuleCase) -> None:
    assert admit(kind, case.invalid()) == []


def test_unchanged_update_passes_every_transition_rule() -> None:
    obj = experiment("a").rank(32).alpha(64).modules("q_proj", "o_proj").obj()
    assert admit("LoRAExperiment", obj, old=obj) == []


@pytest.mark.parametrize(
    ("kind", "obj", "broken"),
    [
        ("LoRAExperiment", experiment("a").obj(), []),
        ("EnginePool", pool().obj(), []),
        (
            "EnginePool",
            pool().replicas(0, 2).template(volumeMounts=[]).obj(),
            ["a pool of more than one engine needs checkpoint.volume"],
        ),
    ],
)
def test_rules_guard_optional_fields(kind: str, obj: Obj, broken: list[str]) -> None:
    """Rules must evaluate (not error) on objects before defaulting: has() guards."""
    schema = schema_of(kind)
    # cel_errors raises if a rule reads a missing field; otherwise it lists broken rules
    failed = cel_errors(schema, obj, old=obj)
    assert [m for m in failed if not any(m.startswith(b) for b in broken)] == []
    assert len(failed) == len(broken)
