import json
import random
from pathlib import Path

import pytest
from loraplex_engine.spec.errors import TaskError
from loraplex_engine.tasks import (
    ArithmeticTask,
    CopyTask,
    JsonlTask,
    Prompt,
    ShortReplyTask,
    TargetTokenTask,
    build_task,
    check_task,
)
from loraplex_engine.tasks.rewards import HttpReward


@pytest.mark.parametrize("name", ["target-token", "copy", "arithmetic", "short-reply"])
def test_prompts_are_deterministic_given_the_seed(name: str) -> None:
    task = build_task(name)
    a = task.sample_prompts(16, random.Random(7))
    b = task.sample_prompts(16, random.Random(7))
    c = task.sample_prompts(16, random.Random(8))
    assert a == b and a != c and len(a) == 16


def test_target_token_rewards_partial_then_full_credit() -> None:
    task = TargetTokenTask({"target": "no"})
    prompt = task.sample_prompts(1, random.Random(0))[0]
    assert prompt.answer == "no" and prompt.text.endswith("say no:")
    noise = task.reward(prompt, " no#$xyz")
    assert 0 < noise < 1
    assert task.reward(prompt, " no no no") == 1.0
    assert task.reward(prompt, " yes yes") == 0.0
    assert noise < task.reward(prompt, " no no xyz")


def test_target_must_be_one_word() -> None:
    with pytest.raises(TaskError) as info:
        TargetTokenTask({"target": "two words"})
    assert info.value.field == "spec.task.params.target"


def test_copy_prompts_and_reward() -> None:
    task = CopyTask({"length": "4", "alphabet": "xy"})
    prompts = task.sample_prompts(8, random.Random(0))
    assert all(len(p.answer) == 4 and set(p.answer) <= {"x", "y"} for p in prompts)
    assert all(p.text == f"copy {p.answer}:" for p in prompts)
    p = Prompt("copy abc:", "abc")
    assert task.reward(p, " abc") == 1.0
    assert task.reward(p, " abz") == pytest.approx(2 / 3)
    assert task.reward(p, " zzz") == 0.0


def test_arithmetic_exact_by_default_partial_on_request() -> None:
    task = ArithmeticTask({"maxOperand": "20"})
    for p in task.sample_prompts(20, random.Random(1)):
        a, b = (int(x) for x in p.text.rstrip(" =").split(" + "))
        assert p.answer == str(a + b) and 0 <= a <= 20 and 0 <= b <= 20
    p = Prompt("12 + 7 =", "19")
    assert task.reward(p, " 19 and more") == 1.0
    assert task.reward(p, " 18") == 0.0
    partial = ArithmeticTask({"partialCredit": "true"})
    assert partial.reward(p, " 18") == pytest.approx(0.25)
    assert partial.reward(p, " 19") == 1.0


@pytest.mark.parametrize(
    ("name", "params", "field"),
    [
        ("copy", {"lenght": "3"}, "spec.task.params.lenght"),
        ("copy", {"length": "three"}, "spec.task.params.length"),
        ("copy", {"length": "0"}, "spec.task.params.length"),
        ("arithmetic", {"partialCredit": "maybe"}, "spec.task.params.partialCredit"),
        ("chess", {}, "spec.task.name"),
    ],
)
def test_bad_params_name_the_field(name: str, params: dict[str, str], field: str) -> None:
    with pytest.raises(TaskError) as info:
        check_task(name, params)
    assert info.value.field == field


def test_reward_override_and_http() -> None:
    task = build_task("target-token", {"target": "yes"}, reward="contains")
    assert task.reward(Prompt("say yes:", "yes"), " no yes") == 1.0
    http = build_task("copy", reward="http", reward_url="http://127.0.0.1:9/score")
    assert isinstance(http.reward_fn, HttpReward)
    http.close()
    task.close()  # built-in reward: nothing to release, must not fail
    with pytest.raises(TaskError, match="rewardUrl"):
        build_task("copy", reward="http")
    with pytest.raises(TaskError, match="unknown reward"):
        build_task("copy", reward="vibes")


def test_score_checks_lengths() -> None:
    with pytest.raises(ValueError, match="2 prompts for 1 completions"):
        build_task("copy").score([Prompt("a", "a")] * 2, ["a"])


def _row(prompt: str, answer: str) -> str:
    return json.dumps({"prompt": prompt, "answer": answer})


def _answers(task: JsonlTask) -> list[str]:
    return [task.row(i).answer for i in range(len(task))]


def test_jsonl_reads_rows_and_scores_exact_match(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(_row("2 + 2 =", "4") + "\n\n" + _row("capital of France?", "Paris") + "\n")
    task = build_task("jsonl", dataset=str(path))
    assert isinstance(task, JsonlTask) and len(task) == 2
    prompts = task.sample_prompts(10, random.Random(0))
    assert prompts == task.sample_prompts(10, random.Random(0))
    assert {p.answer for p in prompts} == {"4", "Paris"}
    assert task.reward(Prompt("q", "Paris"), " Paris ") == 1.0
    assert task.reward(Prompt("q", "Paris"), "paris") == 0.0


def test_jsonl_picks_up_appended_rows_and_waits_for_half_lines(tmp_path: Path) -> None:
    path = tmp_path / "grow.jsonl"
    path.write_text(_row("a", "1") + "\n")
    task = JsonlTask(path)
    half = _row("b", "2")
    with path.open("a") as f:
        f.write(half[:7])  # a writer mid-line
    task.sample_prompts(1, random.Random(0))
    assert _answers(task) == ["1"]
    with path.open("a") as f:
        f.write(half[7:])  # complete, but no newline yet: taken
    task.sample_prompts(1, random.Random(0))
    assert _answers(task) == ["1", "2"]
    with path.open("a") as f:
        f.write("\n" + _row("c", "3") + "\n")
    task.sample_prompts(1, random.Random(0))
    assert _answers(task) == ["1", "2", "3"]
    assert task.refresh() == 0


def test_jsonl_reloads_a_replaced_file(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(_row("a long prompt here", "1") + "\n" + _row("b", "2") + "\n")
    task = JsonlTask(path)
    path.write_text(_row("z", "9") + "\n")
    task.refresh()
    assert _answers(task) == ["9"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json\n", r"d.jsonl:1: invalid JSON"),
        (_row("a", "1") + "\n" + '{"prompt": "b", "answer": 2}\n', r"d.jsonl:2: row must be"),
        ('["a", "b"]\n', "row must be"),
    ],
)
def test_jsonl_bad_rows_are_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(TaskError, match=message) as info:
        JsonlTask(path)
    assert info.value.field == "spec.task.dataset"


def test_jsonl_missing_or_empty(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="does not exist"):
        build_task("jsonl", dataset=str(tmp_path / "nope.jsonl"))
    with pytest.raises(TaskError, match="required for task jsonl"):
        build_task("jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    task = JsonlTask(empty)
    with pytest.raises(TaskError, match="has no rows"):
        task.sample_prompts(1, random.Random(0))
    empty.write_text(_row("x", "y") + "\n")
    assert task.sample_prompts(1, random.Random(0))[0].answer == "y"


def test_jsonl_with_a_root_refuses_a_file_swapped_for_a_symlink_out(tmp_path: Path) -> None:
    own, other = tmp_path / "team-a", tmp_path / "team-b"
    own.mkdir()
    other.mkdir()
    (other / "private.jsonl").write_text(_row("secret", "x") + "\n")
    path = own / "d.jsonl"
    path.write_text(_row("mine", "y") + "\n")
    task = JsonlTask(path, root=own)
    assert [p.text for p in task.sample_prompts(1, random.Random(0))] == ["mine"]
    path.unlink()
    path.symlink_to(other / "private.jsonl")  # after admission: re-checked on every read
    with pytest.raises(TaskError, match="not allowed") as info:
        task.sample_prompts(1, random.Random(0))
    assert info.value.field == "spec.task.dataset"


def test_short_reply_rewards_every_word_fewer_up_to_the_limit() -> None:
    task = ShortReplyTask({"maxWords": "4"})
    prompt = task.sample_prompts(1, random.Random(0))[0]
    assert prompt.text.endswith("Answer in at most 4 words.")
    scores = [
        task.reward(prompt, c)
        for c in (
            "",
            "Blue.",
            "It is blue.",
            "The sky is blue.",
            "The sky is blue today.",
            " ".join(["word"] * 16),
        )
    ]
    assert scores == [0.0, 1.0, 1.0, 1.0, 0.8, 0.25]


@pytest.mark.parametrize("value", ["0", "many", "1001"])
def test_short_reply_names_a_bad_word_limit(value: str) -> None:
    with pytest.raises(TaskError) as info:
        check_task("short-reply", {"maxWords": value})
    assert info.value.field == "spec.task.params.maxWords"
