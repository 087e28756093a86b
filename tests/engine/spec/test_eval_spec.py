"""spec.eval as a tenant writes it: each rule refused naming its field, its rows bounded
in the step cost the engine admits, and its eval set fixed from the task or the first
rows of a dataset opened under task.dataset's rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from loraplex_engine.evaluation.eval_set import build_eval_set
from loraplex_engine.spec.errors import InvalidSpecError, SpecError, TaskError
from loraplex_engine.spec.experiment import parse_spec
from loraplex_engine.tasks import build_task
from loraplex_engine.tenancy.trust import TrustPolicy
from loraplex_engine.tenancy.work_limits import WorkLimits

TASK = {"name": "arithmetic"}


def _spec(ev: Any, **top: Any) -> dict[str, Any]:
    return {"task": TASK, "eval": ev, **top}


@pytest.mark.parametrize(
    ("ev", "field", "words"),
    [
        ({"everySteps": 0}, "spec.eval.everySteps", "greater than or equal to 1"),
        ({"everySteps": 1_000_001}, "spec.eval.everySteps", "less than or equal"),
        ({"prompts": 0}, "spec.eval.prompts", "greater than or equal to 1"),
        ({"prompts": 65}, "spec.eval.prompts", "less than or equal to 64"),
        ({"samples": 17, "temperature": 1.0}, "spec.eval.samples", "less than or equal to 16"),
        ({"samples": 2}, "spec.eval.samples", "needs eval.temperature > 0"),
        ({"passAtK": 2}, "spec.eval.passAtK", "at most eval.samples"),
        ({"passAtK": 0}, "spec.eval.passAtK", "greater than or equal to 1"),
        ({"temperature": 2.5}, "spec.eval.temperature", "less than or equal to 2"),
        ({"passThreshold": float("nan")}, "spec.eval.passThreshold", "finite"),
        ({"passThreshold": 2e9}, "spec.eval.passThreshold", "less than or equal"),
        ({"dataset": ""}, "spec.eval.dataset", "at least 1 character"),
        ({"prompts": "8"}, "spec.eval.prompts", "valid integer"),  # no coercion
        ({"typo": 1}, "spec.eval.typo", "unknown field"),
        ("yes", "spec.eval", "EvalSpec"),
    ],
)
def test_each_rule_is_refused_naming_its_field(ev: Any, field: str, words: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(_spec(ev))
    assert info.value.field == field, info.value
    assert words.lower() in info.value.message.lower(), info.value.message


def test_a_client_experiment_has_no_eval() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({"client": {"modelId": "s1:train:0"}, "eval": {}})
    assert info.value.field == "spec.eval" and "spec.task's reward" in info.value.message


def test_defaults_and_round_trip() -> None:
    spec = parse_spec(_spec({}))
    ev = spec.evaluation
    assert ev is not None
    assert (ev.every_steps, ev.prompts, ev.samples, ev.pass_at_k) == (10, 16, 1, 1)
    assert (ev.temperature, ev.pass_threshold, ev.dataset) == (0.0, 1.0, None)
    body = spec.to_json()["eval"]
    assert parse_spec(_spec(body)).evaluation == ev
    assert parse_spec({"task": TASK}).evaluation is None


def test_the_eval_counts_in_the_step_cost_the_engine_admits() -> None:
    # Prompt limit 100, maxNewTokens 28: 128 tokens a row; a step of 2 x 2 rows.
    limits = WorkLimits(max_prompt_tokens=100, max_step_tokens=128 * 12, context_tokens=None)
    body = {
        "task": TASK,
        "algorithm": {"groupSize": 2, "promptsPerStep": 2},
        "rollout": {"maxNewTokens": 28},
    }
    limits.check_step(parse_spec(body))
    fits = {"prompts": 4, "samples": 2, "temperature": 1.0, "passAtK": 2}  # 4 + 8 rows
    limits.check_step(parse_spec({**body, "eval": fits}))
    with pytest.raises(InvalidSpecError) as info:
        limits.check_step(parse_spec({**body, "eval": {**fits, "prompts": 5}}))  # 14 rows
    assert info.value.field == "spec.eval.prompts"
    assert "1792 tokens" in info.value.message and "--max-step-tokens" in info.value.message


def test_an_eval_set_from_the_task_is_fixed_by_the_seed() -> None:
    task = build_task("arithmetic", {"maxOperand": "1000"})

    def prompts(seed: int) -> list[str]:
        spec = parse_spec({**_spec({"prompts": 8}), "algorithm": {"seed": seed}})
        eval_set = build_eval_set(spec, task, TrustPolicy(), "ns")
        assert eval_set is not None
        return [p.text for p in eval_set.prompts]

    assert len(prompts(0)) == 8 and prompts(0) == prompts(0)
    assert prompts(0) != prompts(1)
    no_eval = parse_spec({"task": TASK})
    assert build_eval_set(no_eval, task, TrustPolicy(), "ns") is None


def test_an_eval_with_a_multi_turn_environment_is_refused_naming_the_eval() -> None:
    """An environment scores whole episodes, an eval's single-turn rows the task's reward:
    the engine refuses the pair rather than report a number that measures neither."""
    env = {"name": "gsm8k_multi_turn"}
    spec = parse_spec({**_spec({}), "task": {**TASK, "environment": env}})
    with pytest.raises(TaskError) as info:
        build_eval_set(spec, build_task("arithmetic"), TrustPolicy(), "ns")
    assert info.value.field == "spec.eval"
    assert "task.environment" in info.value.message


def _rows(path: Path, n: int) -> Path:
    path.write_text(
        "".join(json.dumps({"prompt": f"q{i}", "answer": f"a{i}"}) + "\n" for i in range(n))
    )
    return path


def _eval_set_of(root: Path, ev: dict[str, Any]) -> Any:
    spec = parse_spec(_spec(ev))
    return build_eval_set(spec, build_task("arithmetic"), TrustPolicy.local([root]), "ns")


def test_an_eval_dataset_gives_its_first_rows(tmp_path: Path) -> None:
    _rows(tmp_path / "held.jsonl", 10)
    got = _eval_set_of(tmp_path, {"dataset": "held.jsonl", "prompts": 4})
    assert [(p.text, p.answer) for p in got.prompts] == [(f"q{i}", f"a{i}") for i in range(4)]
    fewer = _eval_set_of(tmp_path, {"dataset": "held.jsonl", "prompts": 64})
    assert len(fewer.prompts) == 10  # a smaller file: all of it


@pytest.mark.parametrize(
    ("write", "dataset", "words"),
    [
        (lambda d: None, "missing.jsonl", "does not exist"),  # the local policy says so
        (lambda d: None, "/etc/passwd", "not allowed"),  # outside the data root
        (lambda d: (d / "empty.jsonl").write_text(""), "empty.jsonl", "has no rows"),
        (lambda d: (d / "bad.jsonl").write_text('{"prompt": 1}\n'), "bad.jsonl", "bad.jsonl:1"),
    ],
)
def test_a_bad_eval_dataset_names_the_eval_field(
    tmp_path: Path, write: Any, dataset: str, words: str
) -> None:
    write(tmp_path)
    with pytest.raises(TaskError) as info:
        _eval_set_of(tmp_path, {"dataset": dataset})
    assert info.value.field == "spec.eval.dataset" and words in info.value.message


def test_an_eval_dataset_in_any_format_with_its_columns(tmp_path: Path) -> None:
    """eval.dataset is read as task.dataset is: here Parquet (through the bounded reader
    process and the spool), its prompt and answer in the columns datasetOptions names."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"question": [f"q{i}" for i in range(6)], "gold": [str(i) for i in range(6)]})
    pq.write_table(table, tmp_path / "held.parquet")
    options = {"columns": {"prompt": "question", "answer": "gold"}}
    got = _eval_set_of(tmp_path, {"dataset": "held.parquet", "datasetOptions": options})
    assert [(p.text, p.answer) for p in got.prompts] == [(f"q{i}", str(i)) for i in range(6)]
    with pytest.raises(TaskError) as info:  # a column it does not have
        _eval_set_of(tmp_path, {"dataset": "held.parquet"})
    assert info.value.field == "spec.eval.dataset" and "prompt" in info.value.message


def test_eval_dataset_options_errors_name_the_eval_fields(tmp_path: Path) -> None:
    _rows(tmp_path / "held.jsonl", 3)
    with pytest.raises(TaskError) as info:
        _eval_set_of(tmp_path, {"dataset": "held.jsonl", "datasetOptions": {"split": "test"}})
    assert info.value.field == "spec.eval.datasetOptions.split"
    assert "only hf-disk" in info.value.message
