"""The GSM8K-style workload's pure parts: the generator, answer extraction, the gsm8k
task, and the committed sample file (what scripts/gen_gsm8k_sample.py writes)."""

from __future__ import annotations

import importlib.util
import json
import random
import re
from fractions import Fraction

import pytest
from loraplex_engine.spec.errors import TaskError
from loraplex_engine.tasks import build_task, check_task
from loraplex_engine.tasks.gsm8k_problems import generate
from loraplex_engine.tasks.math_answer import (
    ANSWER_CHARS,
    as_number,
    final_answer,
    gold_answer,
    number_matches,
    risky,
)

from tests.support.paths import REPO_ROOT

_CALC = re.compile(r"<<(\d+)([-+*/])(\d+)=(\d+)>>")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _check_solution(solution: str, answer: int, steps: int) -> None:
    """Every calculator annotation is right, each step uses the previous result, and the
    last line is GSM8K's ``#### answer``."""
    lines = solution.splitlines()
    assert lines[-1] == f"#### {answer}"
    calcs = [_CALC.search(line) for line in lines[:-1]]
    assert len(calcs) == steps and all(calcs)
    previous = None
    for m in calcs:
        assert m is not None
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        got = Fraction(a, b) if op == "/" else _OPS[op](a, b)
        assert got == c and c >= 0
        assert previous is None or a == previous  # a chain on one running count
        previous = c
    assert previous == answer


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 6])
def test_generated_problems_have_the_steps_asked_and_right_answers(steps: int) -> None:
    rng = random.Random(steps)
    for _ in range(200):
        p = generate(rng, steps, steps, hi=50)
        assert p.steps == steps
        _check_solution(p.solution, p.answer, steps)
        assert p.question.endswith("have now?")


def test_generation_is_seeded() -> None:
    a = [generate(random.Random(3), 1, 4) for _ in range(1)]
    b = [generate(random.Random(3), 1, 4) for _ in range(1)]
    c = [generate(random.Random(4), 1, 4) for _ in range(1)]
    assert a == b != c


def test_a_range_of_steps_gives_each_number_of_steps() -> None:
    rng = random.Random(0)
    seen = {generate(rng, 1, 4).steps for _ in range(200)}
    assert seen == {1, 2, 3, 4}


@pytest.mark.parametrize(
    ("completion", "want"),
    [
        ("5+3=8 so\n#### 8", "8"),
        ("#### 8\nthen I said 9", "8"),  # the #### line wins over a later number
        ("The answer is \\boxed{\\frac{16}{2}}.", "\\frac{16}{2}"),
        ("first 3, then 12 apples", "12"),
        ("#### 1,000.", "1,000."),
        ("no digits here", None),
        ("####   \n", None),
    ],
)
def test_final_answer(completion: str, want: str | None) -> None:
    assert final_answer(completion) == want


def test_only_the_tail_of_a_huge_completion_is_read() -> None:
    huge = "#### 7\n" + "x" * 10**6 + " 8"
    assert final_answer(huge) == "8"  # the early #### is past the tail: not seen
    assert len(final_answer("#### " + "9" * 10_000) or "") == ANSWER_CHARS


def test_gold_answer_and_numbers() -> None:
    assert gold_answer("Tom has 2*3 = <<2*3=6>>6.\n#### 6") == "6"
    assert gold_answer(" 42 ") == "42"
    assert as_number("$1,000") == 1000 and as_number("-3/4") == Fraction(-3, 4)
    assert as_number("18.0") == 18 and as_number("18 apples") is None
    assert number_matches("so #### 18 apples", "x\n#### 18")
    assert not number_matches("so #### 19", "18") and not number_matches("none", "18")


@pytest.mark.parametrize("answer", ["9^{9^{9}}", "99**99999", "(10^10)!", "1e999999"])
def test_answers_that_could_explode_are_flagged(answer: str) -> None:
    assert risky(answer)
    assert not risky("\\frac{36}{2}") and not risky("1,000")


def test_the_gsm8k_task_scores_its_own_problems() -> None:
    task = build_task("gsm8k", {"minSteps": "2", "maxSteps": "2", "maxNumber": "20"})
    prompts = task.sample_prompts(8, random.Random(0))
    assert all(p.text.endswith("after ####.") for p in prompts)
    right = [f"... #### {p.answer}" for p in prompts]
    wrong = [f"... #### {int(p.answer) + 1}" for p in prompts]
    assert task.score(prompts, right) == [1.0] * 8
    assert task.score(prompts, wrong) == [0.0] * 8
    no_hint = build_task("gsm8k", {"hint": "false"}).sample_prompts(1, random.Random(0))[0]
    assert no_hint.text.endswith("have now?")


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"minSteps": "0"}, "spec.task.params.minSteps"),
        ({"maxSteps": "99"}, "spec.task.params.maxSteps"),
        ({"minSteps": "3", "maxSteps": "2"}, "spec.task.params.minSteps"),
        ({"maxNumber": "1"}, "spec.task.params.maxNumber"),
        ({"hint": "maybe"}, "spec.task.params.hint"),
        ({"steps": "2"}, "spec.task.params.steps"),
    ],
)
def test_bad_params_name_the_field(params: dict[str, str], field: str) -> None:
    with pytest.raises(TaskError) as err:
        check_task("gsm8k", params)
    assert err.value.field == field


def test_the_committed_sample_is_what_the_script_writes() -> None:
    path = REPO_ROOT / "scripts" / "gen_gsm8k_sample.py"
    spec = importlib.util.spec_from_file_location("gen_gsm8k_sample", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    committed = (REPO_ROOT / "samples" / "local" / "gsm8k-sample.jsonl").read_text()
    assert committed == script.render()
    for line in committed.splitlines():
        row = json.loads(line)
        assert set(row) == {"question", "answer"}
        assert row["answer"].splitlines()[-1].startswith("#### ")
