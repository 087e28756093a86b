import copy
from typing import Any, get_args

import pytest
from loraplex_engine.local.manifests import check_task, validate_for_engine
from loraplex_engine.spec.errors import SpecError
from loraplex_engine.spec.experiment import (
    ExperimentSpec,
    TaskName,
    all_spec_errors,
    parse_spec,
)
from loraplex_engine.spec.plugins import BUILTIN_REWARDS
from loraplex_engine.tasks import REWARD_NAMES, TASKS
from pydantic import ValidationError

# The example from docs/engine-api.md, verbatim.
DOC_EXAMPLE: dict[str, Any] = {
    "enginePool": "pool-a",
    "lora": {"rank": 8, "alpha": 16, "dropout": 0.0, "targetModules": ["q_proj", "v_proj"]},
    "task": {
        "name": "jsonl",
        "params": {},
        "dataset": "/data/train.jsonl",
        "reward": "http",
        "rewardUrl": "http://rewards:8080/score",
        "chatTemplate": False,
    },
    "algorithm": {
        "name": "grpo",
        "groupSize": 8,
        "promptsPerStep": 4,
        "learningRate": 0.0005,
        "lrSchedule": "constant",
        "warmupSteps": 0,
        "maxGradNorm": 1.0,
        "klCoef": 0.0,
        "clip": 0.2,
        "offPolicyCorrection": "tis",
        "tisCap": 2.0,
        "clipHigh": 0.28,
        "importanceSamplingLevel": "token",
        "advantageEstimator": "grpo",
        "scaleRewards": "group",
        "lossAggregation": "seq-mean-token-mean",
        "klEstimator": "k3",
        "dynamicSampling": False,
        "overlong": {"bufferTokens": 4, "penalty": 1.0},
        "maxStaleness": 0,
        "maxSteps": 50,
        "seed": 0,
    },
    "rollout": {"maxNewTokens": 8, "temperature": 1.0, "reproducible": False},
    "checkpoint": {"everySteps": 10, "keep": 3},
    "tracking": {"runName": "lr-5e-4", "tags": [{"name": "sweep", "value": "lr"}]},
    "priorityClassName": "high",
    "priority": 0,
    "suspend": False,
}


def with_change(path: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(DOC_EXAMPLE)
    *parents, leaf = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    node[leaf] = value
    return data


def test_doc_example_round_trips_field_for_field() -> None:
    spec = parse_spec(DOC_EXAMPLE)
    assert spec.to_json() == DOC_EXAMPLE
    assert spec.algorithm.learning_rate == 0.0005 and spec.lora.target_modules == [
        "q_proj",
        "v_proj",
    ]


def test_defaults_fill_a_minimal_spec() -> None:
    spec = parse_spec({"task": {"name": "copy"}})
    assert (spec.lora.rank, spec.algorithm.group_size, spec.rollout.max_new_tokens) == (8, 8, 64)
    assert spec.task.reward is None and spec.algorithm.max_steps == 50
    assert "enginePool" not in spec.to_json()  # None fields are left out


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("lora.rank", 0, "spec.lora.rank"),
        ("lora.rank", 257, "spec.lora.rank"),
        ("lora.alpha", 0, "spec.lora.alpha"),
        ("lora.dropout", 1.0, "spec.lora.dropout"),
        ("lora.targetModules", [], "spec.lora.targetModules"),
        ("lora.targetModules", ["q proj"], "spec.lora.targetModules.0"),
        ("algorithm.groupSize", 1, "spec.algorithm.groupSize"),
        ("algorithm.groupSize", 257, "spec.algorithm.groupSize"),
        ("algorithm.promptsPerStep", 0, "spec.algorithm.promptsPerStep"),
        ("algorithm.promptsPerStep", 1025, "spec.algorithm.promptsPerStep"),
        ("algorithm.learningRate", 0, "spec.algorithm.learningRate"),
        ("algorithm.learningRate", float("inf"), "spec.algorithm.learningRate"),
        ("algorithm.learningRate", float("nan"), "spec.algorithm.learningRate"),
        ("algorithm.klCoef", -0.1, "spec.algorithm.klCoef"),
        ("algorithm.clip", 0, "spec.algorithm.clip"),
        ("algorithm.clip", 1.5, "spec.algorithm.clip"),
        ("algorithm.offPolicyCorrection", "is", "spec.algorithm.offPolicyCorrection"),
        ("algorithm.tisCap", 0.5, "spec.algorithm.tisCap"),
        ("algorithm.tisCap", 101, "spec.algorithm.tisCap"),
        ("algorithm.tisCap", "2", "spec.algorithm.tisCap"),
        ("algorithm.maxSteps", -1, "spec.algorithm.maxSteps"),
        ("algorithm.name", "ppo", "spec.algorithm.name"),
        ("rollout.maxNewTokens", 0, "spec.rollout.maxNewTokens"),
        ("rollout.maxNewTokens", 4097, "spec.rollout.maxNewTokens"),
        ("rollout.temperature", 2.5, "spec.rollout.temperature"),
        ("rollout.temperature", -0.1, "spec.rollout.temperature"),
        ("checkpoint.everySteps", 0, "spec.checkpoint.everySteps"),
        ("checkpoint.keep", 0, "spec.checkpoint.keep"),
        ("task.name", "chess", "spec.task.name"),
        ("task.reward", "not a name", "spec.task.reward"),
        ("task.params", {"target": 3}, "spec.task.params.target"),
        ("lora.targetModules", ["q_proj", "q_proj"], "spec.lora.targetModules"),
        ("lora.targetModules", [f"m{i}" for i in range(33)], "spec.lora.targetModules"),
        ("lora.targetModules", ["m" * 64], "spec.lora.targetModules.0"),
        ("task.params", {f"k{i}": "v" for i in range(65)}, "spec.task.params"),
        ("task.params", {"target": "y" * 4097}, "spec.task.params.target"),
        ("task.dataset", "/" * 4097, "spec.task.dataset"),
        ("task.rewardUrl", "ftp://rewards/score", "spec.task.rewardUrl"),
        ("task.rewardUrl", "http://rewards/a b", "spec.task.rewardUrl"),
        ("task.rewardUrl", "http://" + "r" * 2042, "spec.task.rewardUrl"),
        ("enginePool", "", "spec.enginePool"),
        ("enginePool", "Pool_A", "spec.enginePool"),
        ("enginePool", "p" * 254, "spec.enginePool"),
        ("lora.rank", "8", "spec.lora.rank"),  # strict, like the CRD's integer type
        ("lora.rnak", 8, "spec.lora.rnak"),
        ("extra", 1, "spec.extra"),
    ],
)
def test_bad_values_are_rejected_naming_the_field(path: str, value: Any, field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(with_change(path, value))
    assert info.value.field == field
    assert field in str(info.value)


def test_bounds_edges_are_accepted() -> None:
    for path, value in [
        ("lora.rank", 256),
        ("algorithm.groupSize", 2),
        ("algorithm.clip", 0.28),  # = the example's clipHigh: clip-higher's rule holds
        ("algorithm.clipHigh", 1.0),
        ("algorithm.importanceSamplingLevel", "sequence"),
        ("algorithm.advantageEstimator", "rloo"),
        ("algorithm.scaleRewards", "none"),
        ("algorithm.lossAggregation", "seq-mean-token-sum-norm"),
        ("algorithm.klEstimator", "k1"),
        ("algorithm.dynamicSampling", True),
        ("algorithm.maxSteps", 0),
        ("rollout.temperature", 0.01),  # 0 is refused by GRPO's rule (below)
        ("rollout.temperature", 2),
        ("rollout.maxNewTokens", 4096),
    ]:
        section, key = path.split(".")
        parsed = parse_spec(with_change(path, value)).to_json()
        assert parsed[section][key] == value, path


def test_unknown_field_says_so() -> None:
    with pytest.raises(SpecError, match=r"spec.lora.rnak: unknown field"):
        parse_spec(with_change("lora.rnak", 8))


# The CRD's cross-field CEL rules, on the engine's side: each (change, field, message).
# tests/test_spec_drift.py checks that the CRD refuses the same specs with the same words.
CROSS_FIELD_RULES = [
    (
        {"task": {"name": "jsonl"}},
        "spec.task.dataset",
        "task.dataset is required when task.name is jsonl or dataset",
    ),
    (
        {"task": {"name": "dataset"}},
        "spec.task.dataset",
        "task.dataset is required when task.name is jsonl or dataset",
    ),
    (
        {"task": {"name": "copy", "dataset": "/data/train.jsonl"}},
        "spec.task.dataset",
        "task.dataset is only used by the jsonl and dataset tasks",
    ),
    (
        {"task": {"name": "jsonl", "dataset": "x.jsonl", "datasetOptions": {"split": "test"}}},
        "spec.task.datasetOptions",
        "task.datasetOptions is only used by the dataset task",
    ),
    (
        {"task": {"name": "copy", "reward": "http"}},
        "spec.task.rewardUrl",
        "task.rewardUrl is required when task.reward is http",
    ),
    (
        {"task": {"name": "copy", "reward": "exact-match", "rewardUrl": "http://r:80/s"}},
        "spec.task.rewardUrl",
        "task.rewardUrl is only used when task.reward is http",
    ),
    (
        {"task": {"name": "copy", "rewardUrl": "http://r:80/s"}},
        "spec.task.rewardUrl",
        "task.rewardUrl is only used when task.reward is http",
    ),
    (
        {"lora": {"rank": 1, "alpha": 16.5}},
        "spec.lora.alpha",
        "lora.alpha must be at most 16 × lora.rank",
    ),
    (
        {"algorithm": {"groupSize": 256, "promptsPerStep": 33}},
        "spec.algorithm.promptsPerStep",
        "algorithm.groupSize × algorithm.promptsPerStep (completions per step) must be at most",
    ),
    (
        {"rollout": {"temperature": 0}},
        "spec.rollout.temperature",
        "GRPO needs rollout.temperature > 0",
    ),
    (
        {"algorithm": {"clip": 0.2, "clipHigh": 0.1}},
        "spec.algorithm.clipHigh",
        "algorithm.clipHigh must be at least algorithm.clip",
    ),
    (
        {"algorithm": {"overlong": {"bufferTokens": 65}}},  # maxNewTokens defaults to 64
        "spec.algorithm.overlong.bufferTokens",
        "algorithm.overlong.bufferTokens must be at most rollout.maxNewTokens",
    ),
    (
        {"algorithm": {"overlong": {"bufferTokens": 9}}, "rollout": {"maxNewTokens": 8}},
        "spec.algorithm.overlong.bufferTokens",
        "algorithm.overlong.bufferTokens must be at most rollout.maxNewTokens",
    ),
]
# The same rules just holding (edges included).
CROSS_FIELD_VALID = [
    {"task": {"name": "jsonl", "dataset": "/data/train.jsonl"}},
    {"task": {"name": "dataset", "dataset": "s3://datasets/team-a/gsm8k/"}},
    {
        "task": {
            "name": "dataset",
            "dataset": "gsm8k",
            "datasetOptions": {
                "format": "hf-disk",
                "split": "test",
                "columns": {"prompt": "q", "answer": "a"},
            },
        }
    },
    {"task": {"name": "copy", "reward": "http", "rewardUrl": "https://r.example/score"}},
    {"task": {"name": "copy", "reward": "exact-match"}},
    {"lora": {"rank": 1, "alpha": 16}},
    {"lora": {"rank": 256, "alpha": 4096}},
    {"algorithm": {"groupSize": 256, "promptsPerStep": 32}},
    {"rollout": {"temperature": 0.01}},
    {"algorithm": {"clip": 0.2, "clipHigh": 0.2}},
    {
        "algorithm": {"overlong": {"bufferTokens": 8, "penalty": 1.0}},
        "rollout": {"maxNewTokens": 8},
    },
]


@pytest.mark.parametrize(("change", "field", "message"), CROSS_FIELD_RULES)
def test_cross_field_rules_name_the_field(change: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({"task": {"name": "copy"}, **change})
    assert info.value.field == field
    assert info.value.message.startswith(message)


@pytest.mark.parametrize("change", CROSS_FIELD_VALID)
def test_cross_field_rules_accept_what_they_allow(change: dict[str, Any]) -> None:
    parsed = parse_spec({"task": {"name": "copy"}, **change}).to_json()
    for section, fields in change.items():
        assert {k: parsed[section][k] for k in fields} == fields


def test_missing_task_and_non_mapping() -> None:
    with pytest.raises(SpecError, match=r"spec\.task: set exactly one of spec\.task .*client"):
        parse_spec({})
    with pytest.raises(SpecError, match="must be a mapping"):
        parse_spec([1, 2])


def test_all_errors_are_listed() -> None:
    bad = with_change("lora.rank", 0)
    bad["rollout"]["temperature"] = 9
    assert {e.field for e in all_spec_errors(bad)} == {"spec.lora.rank", "spec.rollout.temperature"}
    assert all_spec_errors(DOC_EXAMPLE) == []


def test_validate_for_engine() -> None:
    spec = parse_spec(with_change("lora.rank", 128))
    with pytest.raises(SpecError, match="rank 128 exceeds the engine's max rank 64") as info:
        validate_for_engine(spec, max_rank=64, known_modules=["q_proj", "v_proj"])
    assert info.value.field == "spec.lora.rank"
    spec = parse_spec(with_change("lora.targetModules", ["q_proj", "w_proj"]))
    with pytest.raises(SpecError, match=r"\['w_proj'\]") as info:
        validate_for_engine(spec, max_rank=64, known_modules=["q_proj", "v_proj"])
    assert info.value.field == "spec.lora.targetModules"
    spec = parse_spec(with_change("task.params", {"targt": "yes"}))
    with pytest.raises(SpecError) as info:
        validate_for_engine(spec, max_rank=64, known_modules=["q_proj", "v_proj"])
    assert info.value.field == "spec.task.params.targt"
    validate_for_engine(parse_spec(DOC_EXAMPLE), max_rank=8, known_modules=["q_proj", "v_proj"])


def test_names_match_the_registries() -> None:
    assert set(get_args(TaskName)) == set(TASKS)
    assert set(BUILTIN_REWARDS) == set(REWARD_NAMES)


@pytest.mark.parametrize("value", [1, -5, 2**31])
def test_a_raw_priority_is_refused_naming_the_class_field(value: int) -> None:
    # Retired: a tenant's number would order (and preempt) other tenants' work.
    with pytest.raises(SpecError) as info:
        parse_spec(with_change("priority", value))
    assert info.value.field == "spec.priority"
    assert "no longer honoured" in info.value.message and "priorityClassName" in info.value.message


def test_priority_fields_are_not_part_of_what_the_engine_runs() -> None:
    from loraplex_engine.experiment import adapter_spec

    plain = {k: v for k, v in DOC_EXAMPLE.items() if k not in ("priorityClassName", "priority")}
    assert adapter_spec(parse_spec(plain)) == adapter_spec(parse_spec(DOC_EXAMPLE))


def test_spec_is_immutable() -> None:
    spec = parse_spec(DOC_EXAMPLE)
    with pytest.raises(ValidationError, match="frozen"):
        spec.priority = 3  # type: ignore[misc]
    assert isinstance(spec, ExperimentSpec)


CLIENT = {"modelId": "s0123456789abcdef0123:train:0"}


def test_a_client_spec_has_no_task_and_round_trips() -> None:
    spec = parse_spec({"lora": {"rank": 4}, "client": {**CLIENT, "seed": 3, "trainMlp": False}})
    assert spec.task is None and spec.client is not None
    assert (spec.client.model_id, spec.client.seed, spec.client.train_mlp) == (
        CLIENT["modelId"],
        3,
        False,
    )
    assert spec.client.idle_seconds == 3600 and spec.client.train_unembed
    assert parse_spec(spec.to_json()) == spec
    check_task(spec)  # nothing to check: no task
    validate_for_engine(spec, 8, ["q_proj", "v_proj"])


@pytest.mark.parametrize(
    ("doc", "field", "message"),
    [
        ({"client": CLIENT, "task": {"name": "copy"}}, "spec.task", "set exactly one of"),
        (
            {"client": CLIENT, "lora": {"targetModules": ["q_proj"]}},
            "spec.lora.targetModules",
            "a client experiment chooses its modules by kind",
        ),
        ({"client": {"modelId": "s1:sample:0"}}, "spec.client.modelId", "String should match"),
        ({"client": {**CLIENT, "idleSeconds": -1}}, "spec.client.idleSeconds", "Input should be"),
        ({"client": {**CLIENT, "rank": 4}}, "spec.client.rank", "unknown field"),
    ],
)
def test_client_spec_errors_name_the_field(doc: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(doc)
    assert info.value.field == field
    assert info.value.message.startswith(message)
