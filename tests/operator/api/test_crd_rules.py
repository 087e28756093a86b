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
from loraplex_engine.spec.errors import SpecError
from loraplex_engine.spec.experiment import parse_spec

from tests.support.builders import experiment, pool
from tests.support.crdkit import admit, cel_errors, schema_of, walk_rules

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
_SHM_VOL = {"name": "shm", "emptyDir": {"medium": "Memory"}}
_SHM_MOUNT = {"name": "shm", "mountPath": "/dev/shm"}


def _aliased(alias: str) -> Obj:
    publish = {"aliases": [{"name": alias, "version": "v1"}]}
    return experiment("a").set("spec.publish", publish).obj()


def _publish(block: Obj, with_eval: bool = False) -> Obj:
    b = experiment("a").set("spec.publish", block)
    return (b.set("spec.eval", {}) if with_eval else b).obj()


def _env_params(params: dict[str, str]) -> Obj:
    env = {"name": "gsm8k-calculator", "params": params}
    return experiment("a").set("spec.task", {"name": "gsm8k", "environment": env}).obj()


def _eval(**fields: Any) -> Obj:
    return experiment("a").set("spec.eval", fields).obj()


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
    "algorithm.lrSchedule cosine decays over algorithm.maxSteps": RuleCase(
        valid=lambda: experiment("a").algorithm(lrSchedule="cosine", maxSteps=1).obj(),
        invalid=lambda: experiment("a").algorithm(lrSchedule="cosine", maxSteps=0).obj(),
    ),
    "algorithm.warmupSteps must be less than algorithm.maxSteps": RuleCase(
        valid=lambda: (
            experiment("a").algorithm(lrSchedule="cosine", maxSteps=10, warmupSteps=9).obj()
        ),
        invalid=lambda: (
            experiment("a").algorithm(lrSchedule="cosine", maxSteps=10, warmupSteps=10).obj()
        ),
    ),
    "algorithm.clipHigh must be at least algorithm.clip": RuleCase(
        valid=lambda: experiment("a").algorithm(clip=0.2, clipHigh=0.2).obj(),
        invalid=lambda: experiment("a").algorithm(clip=0.2, clipHigh=0.19).obj(),
    ),
    "algorithm.overlong.bufferTokens must be at most rollout.maxNewTokens": RuleCase(
        valid=lambda: (
            experiment("a").algorithm(overlong={"bufferTokens": 16}).rollout(maxNewTokens=16).obj()
        ),
        invalid=lambda: (
            experiment("a").algorithm(overlong={"bufferTokens": 17}).rollout(maxNewTokens=16).obj()
        ),
    ),
    "spec.enginePool is immutable": RuleCase(
        valid=lambda: experiment("a").pool("pool-a").priority_class("high").obj(),
        invalid=lambda: experiment("a").pool("pool-b").obj(),
        old=lambda: experiment("a").pool("pool-a").obj(),
    ),
    "spec.lora is immutable": RuleCase(
        valid=lambda: experiment("a").rank(16).suspend().obj(),
        invalid=lambda: experiment("a").rank(32).obj(),
        old=lambda: experiment("a").rank(16).obj(),
    ),
    "spec.task is immutable": RuleCase(
        valid=lambda: experiment("a").reward("exact-match").priority_class("low").obj(),
        invalid=lambda: experiment("a").reward("contains").obj(),
        old=lambda: experiment("a").reward("exact-match").obj(),
    ),
    "spec.algorithm is immutable": RuleCase(
        valid=lambda: experiment("a").algorithm(learningRate=0.01).checkpoint(keep=9).obj(),
        invalid=lambda: experiment("a").algorithm(learningRate=0.02).obj(),
        old=lambda: experiment("a").algorithm(learningRate=0.01).obj(),
    ),
    "spec.rollout is immutable": RuleCase(
        valid=lambda: experiment("a").rollout(temperature=0.7).suspend().obj(),
        invalid=lambda: experiment("a").rollout(temperature=0.8).obj(),
        old=lambda: experiment("a").rollout(temperature=0.7).obj(),
    ),
    "lora.alpha must be at most 16 × lora.rank": RuleCase(
        valid=lambda: experiment("a").rank(1).alpha(16).obj(),
        invalid=lambda: experiment("a").rank(1).alpha(16.5).obj(),
    ),
    "task.dataset is required when task.name is jsonl or dataset": RuleCase(
        valid=lambda: experiment("a").task("dataset", dataset="s3://data/a/x.parquet").obj(),
        invalid=lambda: experiment("a").task("dataset").obj(),
    ),
    "task.dataset is only used by the jsonl and dataset tasks": RuleCase(
        valid=lambda: experiment("a").task("copy").obj(),
        invalid=lambda: experiment("a").task("copy", dataset="/data/train.jsonl").obj(),
    ),
    "task.datasetOptions is only used by the dataset task": RuleCase(
        valid=lambda: experiment("a").task("dataset", dataset="x", datasetOptions={}).obj(),
        invalid=lambda: experiment("a").task("jsonl", dataset="x", datasetOptions={}).obj(),
    ),
    "task.rewardUrl is required when task.reward is http": RuleCase(
        valid=lambda: experiment("a").reward("http", "http://rewards:8080/score").obj(),
        invalid=lambda: experiment("a").reward("http").obj(),
    ),
    "task.rewardUrl is only used when task.reward is http": RuleCase(
        valid=lambda: experiment("a").reward("exact-match").obj(),
        invalid=lambda: experiment("a").reward("exact-match", "http://rewards:8080/score").obj(),
    ),
    "set exactly one of spec.task": RuleCase(
        valid=lambda: experiment("a").client().obj(),
        invalid=lambda: experiment("a").client().task("copy").obj(),
    ),
    "a client experiment chooses its modules by kind": RuleCase(
        valid=lambda: experiment("a").client(trainMlp=False).rank(4).obj(),
        invalid=lambda: experiment("a").client().modules("q_proj").obj(),
    ),
    "spec.client is immutable": RuleCase(
        valid=lambda: experiment("a").client(idleSeconds=5).suspend().obj(),
        invalid=lambda: experiment("a").client(idleSeconds=6).obj(),
        old=lambda: experiment("a").client(idleSeconds=5).obj(),
    ),
    "a LoRAExperiment is trained by its task or by its client for life": RuleCase(
        valid=lambda: experiment("a").suspend().obj(),
        invalid=lambda: experiment("a").client().obj(),
        old=lambda: experiment("a").obj(),
    ),
    # 0 passes: the API server used to default it into every stored experiment.
    "publish.aliases: 'latest' is the engine's own alias": RuleCase(
        valid=lambda: _aliased("stable"),
        invalid=lambda: _aliased("latest"),
    ),
    "spec.publish.promoteWhen gates on an eval score": RuleCase(
        valid=lambda: _publish({"promoteWhen": {"score": "evalPassAtK", "atLeast": 0.5}}, True),
        invalid=lambda: _publish({"promoteWhen": {"score": "evalReward", "atLeast": 0.5}}),
    ),
    "spec.publish.onEvalImprovement publishes after an eval": RuleCase(
        valid=lambda: _publish({"onEvalImprovement": "evalReward"}, True),
        invalid=lambda: _publish({"onEvalImprovement": "evalPassAtK"}),
    ),
    "spec.eval scores completions with spec.task's reward": RuleCase(
        valid=lambda: experiment("a").set("spec.eval", {}).obj(),
        invalid=lambda: experiment("a").client().set("spec.eval", {}).obj(),
    ),
    "eval.passAtK must be at most eval.samples": RuleCase(
        valid=lambda: _eval(samples=4, passAtK=4, temperature=1.0),
        invalid=lambda: _eval(samples=4, passAtK=5, temperature=1.0),
    ),
    "eval.samples > 1 needs eval.temperature > 0": RuleCase(
        valid=lambda: _eval(samples=2, temperature=0.1),
        invalid=lambda: _eval(samples=2, temperature=0.0),
    ),
    "task.params names must be 1 to 128 characters": RuleCase(
        valid=lambda: experiment("a").set("spec.task.params", {"a" * 128: "1"}).obj(),
        invalid=lambda: experiment("a").set("spec.task.params", {"a" * 129: "1"}).obj(),
    ),
    "task.environment.params names must be 1 to 128 characters": RuleCase(
        valid=lambda: _env_params({"a" * 128: "1"}),
        invalid=lambda: _env_params({"a" * 129: "1"}),
    ),
    "spec.priority is no longer honoured": RuleCase(
        valid=lambda: experiment("a").priority(0).obj(),
        invalid=lambda: experiment("a").priority(1).obj(),
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
        invalid=lambda: pool().template(volumes=[{"name": "loraplex-shm", "emptyDir": {}}]).obj(),
    ),
    "every template.volumeMounts entry must name a volume": RuleCase(
        valid=lambda: (
            pool()
            .template(volumes=[_MODEL_VOL], volumeMounts=[{"name": "models", "mountPath": "/m"}])
            .obj()
        ),
        invalid=lambda: pool().template(volumeMounts=[{"name": "models", "mountPath": "/m"}]).obj(),
    ),
    "template.volumeMounts must not mount /dev/shm when gpusPerEngine is above 1": RuleCase(
        valid=lambda: pool().gpus(1).template(volumes=[_SHM_VOL], volumeMounts=[_SHM_MOUNT]).obj(),
        invalid=lambda: (
            pool().gpus(2).template(volumes=[_SHM_VOL], volumeMounts=[_SHM_MOUNT]).obj()
        ),
    ),
    "shardBase needs gpusPerEngine of 2 or more": RuleCase(
        valid=lambda: pool().gpus(2).shard_base().obj(),
        invalid=lambda: pool().gpus(1).shard_base().obj(),
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


# The engine's pydantic models carry the same rules (the CRD's are generated from them):
# a spec rule's cases get the same verdict from parse_spec, and the same words.
_SPEC_RULES = [
    rule for rule in walk_rules(schema_of("LoRAExperiment"))
    if rule.path[:1] == ("spec",) and not rule.is_transition
]  # fmt: skip


@pytest.mark.parametrize("rule", _SPEC_RULES, ids=lambda r: r.message[:50])
def test_engine_refuses_what_the_spec_rule_refuses(rule: Any) -> None:
    case = next(c for key, c in EXPERIMENT_RULES.items() if rule.message.startswith(key))
    parse_spec(case.valid()["spec"])
    with pytest.raises(SpecError) as info:
        parse_spec(case.invalid()["spec"])
    assert info.value.message == rule.message


def test_spec_rules_are_found() -> None:
    assert len(_SPEC_RULES) == 23  # guards the test above against a walker that finds none


@pytest.mark.parametrize(("kind", "message", "case"), [p for p in PARAMS if p.values[2].old])
def test_transition_rule_skipped_on_create(kind: str, message: str, case: RuleCase) -> None:
    assert admit(kind, case.invalid()) == []


def test_unchanged_update_passes_every_transition_rule() -> None:
    obj = experiment("a").rank(32).alpha(64).modules("q_proj", "o_proj").obj()
    assert admit("LoRAExperiment", obj, old=obj) == []


# --- which spec fields an update may change --------------------------------------------
# Every leaf of the experiment spec is classified here (test_every_spec_field_is_classified):
# a new field needs a deliberate decision, and a test that the API server enforces it.

_POOL = "spec.enginePool is immutable"
_LORA = "spec.lora is immutable"
_TASK = "spec.task is immutable"
_ALG = "spec.algorithm is immutable"
_ROLL = "spec.rollout is immutable"
_CLIENT = "spec.client is immutable"


def _plain() -> Obj:
    return experiment("a").obj()


def _client() -> Obj:
    return experiment("a").client().obj()


def _jsonl() -> Obj:
    return experiment("a").task("jsonl", dataset="/data/a.jsonl").obj()


def _dataset() -> Obj:
    options = {"format": "hf-disk", "split": "train", "columns": {"prompt": "q"}}
    return experiment("a").task("dataset", dataset="gsm8k", datasetOptions=options).obj()


def _overlong() -> Obj:
    return experiment("a").algorithm(overlong={"bufferTokens": 4}).obj()


def _http() -> Obj:
    return experiment("a").reward("http", "http://rewards:8080/a").obj()


def _environment() -> Obj:
    obj = experiment("a").obj()
    obj["spec"]["task"]["environment"] = {"name": "gsm8k_multi_turn", "maxTurns": 4}
    return obj


# (field, new value, rule that refuses it, the object being edited)
IMMUTABLE_EDITS: list[tuple[str, Any, str, Callable[[], Obj]]] = [
    ("spec.enginePool", "pool-b", _POOL, _plain),
    ("spec.lora.rank", 16, _LORA, _plain),
    ("spec.lora.alpha", 8, _LORA, _plain),
    ("spec.lora.dropout", 0.1, _LORA, _plain),
    ("spec.lora.targetModules", ["q_proj"], _LORA, _plain),
    ("spec.task.name", "copy", _TASK, _plain),
    ("spec.task.params", {"target": "no"}, _TASK, _plain),
    ("spec.task.dataset", "/data/b.jsonl", _TASK, _jsonl),
    ("spec.task.datasetOptions.format", "parquet", _TASK, _dataset),
    ("spec.task.datasetOptions.split", "test", _TASK, _dataset),
    ("spec.task.datasetOptions.columns.prompt", "question", _TASK, _dataset),
    ("spec.task.datasetOptions.columns.answer", "solution", _TASK, _dataset),
    ("spec.task.reward", "exact-match", _TASK, _plain),
    ("spec.task.rewardUrl", "http://rewards:8080/b", _TASK, _http),
    ("spec.task.chatTemplate", True, _TASK, _plain),
    ("spec.task.environment.name", "other", _TASK, _environment),
    ("spec.task.environment.params", {"k": "v"}, _TASK, _environment),
    ("spec.task.environment.maxTurns", 2, _TASK, _environment),
    ("spec.task.environment.maxEpisodeTokens", 256, _TASK, _environment),
    ("spec.task.environment.observationFormat", "chat", _TASK, _environment),
    ("spec.algorithm.groupSize", 4, _ALG, _plain),
    ("spec.algorithm.maxStaleness", 1, _ALG, _plain),
    ("spec.algorithm.promptsPerStep", 8, _ALG, _plain),
    ("spec.algorithm.learningRate", 0.001, _ALG, _plain),
    ("spec.algorithm.lrSchedule", "cosine", _ALG, _plain),
    ("spec.algorithm.warmupSteps", 5, _ALG, _plain),
    ("spec.algorithm.maxGradNorm", 1.0, _ALG, _plain),
    ("spec.algorithm.klCoef", 0.05, _ALG, _plain),
    ("spec.algorithm.clip", 0.3, _ALG, _plain),
    ("spec.algorithm.offPolicyCorrection", "tis", _ALG, _plain),
    ("spec.algorithm.tisCap", 4.0, _ALG, _plain),
    ("spec.algorithm.clipHigh", 0.28, _ALG, _plain),
    ("spec.algorithm.importanceSamplingLevel", "sequence", _ALG, _plain),
    ("spec.algorithm.advantageEstimator", "rloo", _ALG, _plain),
    ("spec.algorithm.scaleRewards", "none", _ALG, _plain),
    ("spec.algorithm.lossAggregation", "token-mean", _ALG, _plain),
    ("spec.algorithm.klEstimator", "k1", _ALG, _plain),
    ("spec.algorithm.dynamicSampling", True, _ALG, _plain),
    ("spec.algorithm.overlong.bufferTokens", 8, _ALG, _plain),
    ("spec.algorithm.overlong.penalty", 0.5, _ALG, _overlong),
    ("spec.algorithm.maxSteps", 100, _ALG, _plain),  # raised
    ("spec.algorithm.maxSteps", 10, _ALG, _plain),  # lowered
    ("spec.algorithm.maxSteps", 0, _ALG, _plain),  # made continual
    ("spec.algorithm.seed", 1, _ALG, _plain),
    ("spec.rollout.maxNewTokens", 32, _ROLL, _plain),
    ("spec.rollout.temperature", 0.7, _ROLL, _plain),
    ("spec.rollout.reproducible", True, _ROLL, _plain),
    ("spec.client.modelId", "s0123456789abcdef0123:train:1", _CLIENT, _client),
    ("spec.client.seed", 7, _CLIENT, _client),
    ("spec.client.trainAttn", False, _CLIENT, _client),
    ("spec.client.trainMlp", False, _CLIENT, _client),
    ("spec.client.trainUnembed", False, _CLIENT, _client),
    ("spec.client.idleSeconds", 60, _CLIENT, _client),
]
# The operator acts on these every round, or the engine reads them at the next placement.
MUTABLE_EDITS: list[tuple[str, Any]] = [
    ("spec.priorityClassName", "high"),
    ("spec.suspend", True),
    ("spec.checkpoint.everySteps", 5),
    ("spec.checkpoint.keep", 10),
    ("spec.tracking.runName", "lr-2"),
    ("spec.tracking.tags", [{"name": "sweep", "value": "b"}]),
    # The engine applies a publish edit in place (versions/, docs/versions.md).
    ("spec.publish.everySteps", 5),
    ("spec.publish.keep", 3),
    ("spec.publish.pinned", ["v2"]),
    ("spec.publish.aliases", [{"name": "stable", "version": "v2"}]),
    ("spec.publish.promoteWhen.atLeast", 0.5),
    ("spec.publish.promoteWhen.score", "evalReward"),  # from an object with spec.eval
    ("spec.publish.onEvalImprovement", "evalPassAtK"),  # likewise
    ("spec.publish.requestToken", "release-1"),  # publish one version now
    ("spec.eval.everySteps", 5),
    ("spec.eval.prompts", 8),
    ("spec.eval.dataset", "held-out.jsonl"),
    ("spec.eval.datasetOptions.format", "parquet"),
    ("spec.eval.datasetOptions.split", "test"),
    ("spec.eval.datasetOptions.columns.prompt", "question"),
    ("spec.eval.datasetOptions.columns.answer", "solution"),
    ("spec.eval.samples", 1),
    ("spec.eval.passAtK", 1),
    ("spec.eval.temperature", 0.0),
    ("spec.eval.passThreshold", 0.5),
]
# One allowed value today, so no edit is possible; the spec.algorithm rule covers one, the
# retired spec.priority's own rule (0 only) another.
SINGLE_VALUED = {"spec.algorithm.name", "spec.priority"}
# Edits valid only on an object with spec.eval (and a gate to edit the score of).
_NEEDS_EVAL = {"spec.publish.promoteWhen.score", "spec.publish.onEvalImprovement"}


def _mutable_base(field: str) -> Obj:
    if field not in _NEEDS_EVAL:
        return experiment("a").obj()
    return _publish({"promoteWhen": {"atLeast": 0.5}}, with_eval=True)


def _edited(base: Obj, field: str, value: Any) -> Obj:
    *parents, leaf = field.split(".")
    node = base
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return base


def _spec_leaves(schema: dict[str, Any], path: str) -> set[str]:
    props = schema.get("properties")
    if schema.get("type") != "object" or not props:
        return {path}
    return {leaf for name, sub in props.items() for leaf in _spec_leaves(sub, f"{path}.{name}")}


def test_every_spec_field_is_classified() -> None:
    leaves = _spec_leaves(schema_of("LoRAExperiment")["properties"]["spec"], "spec")
    immutable = {field for field, *_ in IMMUTABLE_EDITS}
    mutable = {field for field, _ in MUTABLE_EDITS}
    assert immutable.isdisjoint(mutable)
    assert immutable | mutable | SINGLE_VALUED == leaves


@pytest.mark.parametrize(
    ("field", "value", "message", "base"),
    IMMUTABLE_EDITS,
    ids=lambda v: getattr(v, "__name__", str(v)[:40]),  # the same in every xdist worker
)
def test_edit_of_immutable_field_is_refused(
    field: str, value: Any, message: str, base: Callable[[], Obj]
) -> None:
    old = base()
    new = _edited(base(), field, value)
    assert admit("LoRAExperiment", new) == []  # a valid object: only the edit is refused
    errors = admit("LoRAExperiment", new, old)
    assert len(errors) == 1 and errors[0].startswith(message), errors
    assert "create a new LoRAExperiment" in errors[0]


@pytest.mark.parametrize(("field", "value"), MUTABLE_EDITS, ids=lambda v: str(v))
def test_edit_of_mutable_field_is_allowed(field: str, value: Any) -> None:
    old = _mutable_base(field)
    new = _edited(_mutable_base(field), field, value)
    assert new != old
    assert admit("LoRAExperiment", new, old) == []


@pytest.mark.parametrize(
    ("old", "new", "refused_by"),
    [
        pytest.param(
            experiment("a").algorithm(maxSteps=500).obj(),
            experiment("a").obj(),
            _ALG,
            id="drop algorithm block holding a non-default",
        ),
        pytest.param(
            experiment("a").rollout(maxNewTokens=64, temperature=1.0).obj(),
            experiment("a").obj(),
            None,
            id="drop rollout block holding the defaults",
        ),
        pytest.param(
            experiment("a").obj(),
            experiment("a").rank(8).alpha(16).dropout(0.0).obj(),
            None,
            id="add lora block spelling out the defaults",
        ),
        pytest.param(
            experiment("a").obj(),
            experiment("a").modules("q_proj", "v_proj").obj(),
            _LORA,
            # No default to compare with: unset means the base model family's own targets.
            id="add targetModules (unset is the family default, not a value)",
        ),
        pytest.param(
            experiment("a").obj(),
            experiment("a").rank(16).obj(),
            _LORA,
            id="add lora block with a non-default",
        ),
        pytest.param(
            experiment("a").obj(),
            experiment("a").set("spec.task", {"name": "target-token"}).obj(),
            _TASK,
            id="drop task.params",
        ),
        pytest.param(
            experiment("a").obj(),
            experiment("a").reward("default").obj(),
            _TASK,
            id="add task.reward, even the default",  # stricter than needed; simple to explain
        ),
        pytest.param(
            experiment("a").checkpoint(everySteps=2, keep=7).obj(),
            experiment("a").obj(),
            None,
            id="drop checkpoint block (mutable)",
        ),
        pytest.param(
            experiment("a").modules("q_proj", "v_proj", "o_proj").obj(),
            experiment("a").modules("o_proj", "q_proj", "v_proj").obj(),
            None,
            id="reorder targetModules (a set: the API server ignores order)",
        ),
    ],
)
def test_adding_or_dropping_an_optional_block(old: Obj, new: Obj, refused_by: str | None) -> None:
    """A dropped block is defaulted again before the rules run (on the server as here), so
    it is a change only if it held something other than the defaults."""
    errors = admit("LoRAExperiment", new, old)
    if refused_by is None:
        assert errors == []
    else:
        assert len(errors) == 1 and errors[0].startswith(refused_by), errors


@pytest.mark.parametrize("kind", sorted(CASES))
def test_transition_rules_sit_on_fields_every_object_has(kind: str) -> None:
    """The API server skips a transition rule where the old or the new object lacks the
    field. Ours sit on required or defaulted fields (each level up to the root), so they
    run on every update, including one that adds or removes the block."""
    schema = schema_of(kind)
    for rule in (r for r in walk_rules(schema) if r.is_transition):
        node = schema
        for step in rule.path:
            assert step not in ("[]", "{}"), rule
            child = node["properties"][step]
            # spec.task and spec.client are optional: the spec-level "for life" rule (on
            # spec, which every object has) refuses adding or removing either.
            kind_block = rule.path[:2] in (("spec", "task"), ("spec", "client"))
            required = step in node.get("required", []) or "default" in child
            assert required or kind_block, (rule.path, step)
            node = child


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
        # Before defaulting: shardBase set, gpusPerEngine absent (the default, one rank).
        ("EnginePool", pool().shard_base().obj(), ["shardBase needs gpusPerEngine"]),
        ("EnginePool", pool().shard_base(False).obj(), []),
    ],
)
def test_rules_guard_optional_fields(kind: str, obj: Obj, broken: list[str]) -> None:
    """Rules must evaluate (not error) on objects before defaulting: has() guards."""
    schema = schema_of(kind)
    # cel_errors raises if a rule reads a missing field; otherwise it lists broken rules
    failed = cel_errors(schema, obj, old=obj)
    assert [m for m in failed if not any(m.startswith(b) for b in broken)] == []
    assert len(failed) == len(broken)
