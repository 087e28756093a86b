"""The calculator tool and the gsm8k-calculator environment (workloads/calculator.py,
workloads/calculator_env.py): arithmetic right, hostile expressions refused with a clear
result (never evaluated, never a hang), and the environment's episodes in a real plug-in
worker found through the engine's own entry point (the ``engine_site`` fixture)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
from loraplex_engine.environments.base import ParamError
from loraplex_engine.environments.session import EnvironmentSession
from loraplex_engine.plugins.host import PluginHost
from loraplex_engine.spec.plugins import EnvironmentSpec
from loraplex_engine.workloads.calculator import (
    MAX_CHARS,
    CalcError,
    calculate,
    evaluate,
)
from loraplex_engine.workloads.calculator_env import CalculatorEnv, tool_call

from tests.support.plugin_install import with_path


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("12*7+3", 87),
        ("48/2", 24),
        ("(3 + 4) * (10 - 8)", 14),
        ("-5 + 2", -3),
        ("0.1*3", Fraction(3, 10)),  # exact: not 0.30000000000000004
        ("1,000 * 2", 2000),  # GSM8K writes thousands with commas
        ("10 ÷ 4 × 2", 5),
    ],
)
def test_arithmetic(expression: str, value: Fraction) -> None:
    assert evaluate(expression) == value


def test_results_are_rendered_as_numbers() -> None:
    assert calculate("48/2") == "24" and calculate("1/3") == "0.333333"
    assert calculate("10/4") == "2.5" and calculate("3.0") == "3"


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("2**10", "no powers"),
        ("9**9**9**9", "no powers"),
        ("__import__('os').system('true')", "only numbers"),
        ("open('/etc/passwd').read()", "only numbers"),
        ("(lambda: 1)()", "only numbers"),
        ("[1] * 10", "only numbers"),
        ("1 if 1 else 2", "only numbers"),
        ("'a' * 10", "only numbers"),
        ("True + True", "only numbers"),
        ("1j * 1j", "only numbers"),
        ("x + 1", "only numbers"),
        ("1e300 * 1e300", "a number is over"),
        ("99999999 * 99999999", "a result is over"),
        ("9" * 20, "a number is over"),
        ("1/0", "division by zero"),
        ("1 +", "cannot parse"),
        ("", "empty expression"),
        ("1+" * 40 + "1", "over 64 terms"),
        ("(" * 150 + "1" + ")" * 150, f"over {MAX_CHARS} characters"),
        ("1" * 10_000_000, f"over {MAX_CHARS} characters"),  # refused before parsing
    ],
)
def test_hostile_expressions_are_refused_saying_why(expression: str, why: str) -> None:
    with pytest.raises(CalcError, match=why):
        evaluate(expression)
    assert calculate(expression).startswith("error: ")


def test_a_product_chain_cannot_grow_a_huge_integer() -> None:
    """Every intermediate is bounded, so no chain within the term limit computes a big
    number: the result check fires at the first product past the bound."""
    with pytest.raises(CalcError, match="a result is over"):
        evaluate("*".join(["999999"] * 20))  # 139 characters, 39 terms


@pytest.mark.parametrize(
    ("turn", "call"),
    [
        ("Let me compute <calc>3*12</calc>", ("3*12", True)),
        ("<calc>1+1</calc> then <calc>2+2</calc>", ("1+1", True)),  # the first call
        ("cut off <calc>3*1", ("3*1", False)),
        ("no tool here #### 36", None),
    ],
)
def test_tool_calls_are_found(turn: str, call: tuple[str, bool] | None) -> None:
    assert tool_call(turn) == call


def test_an_episode_calls_the_tool_then_answers() -> None:
    env = CalculatorEnv("Tom has 3 boxes of 12 apples.", "36", {}, 4)
    assert "<calc>" in env.start()
    first = env.step("I need <calc>3*12</calc>")
    assert first.observation == "\n<result>36</result>\n" and not first.done
    assert first.tool_calls == 1 and first.reward == 0.0
    refused = env.step("<calc>3**99</calc>")
    assert "error: no powers" in refused.observation and not refused.done
    done = env.step("So the answer is\n#### 36")
    assert done.done and done.reward == 1.0 and done.observation == ""
    wrong = CalculatorEnv("q", "36", {"instructions": "false"}, 4)
    assert wrong.start() == "q"
    assert wrong.step("I think it is 35").reward == 0.0  # no tool call: an answer


def test_bad_params_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown param"):
        CalculatorEnv("q", "1", {"tools": "all"}, 2)
    with pytest.raises(ValueError, match="must be true or false"):
        CalculatorEnv("q", "1", {"instructions": "maybe"}, 2)


def test_params_are_checked_before_any_episode_naming_the_param() -> None:
    """check_params is what the engine asks at PUT (environments/worker.py's env_check): the
    default accepts everything, so an unknown param used to be admitted and fail step 1."""
    with pytest.raises(ParamError) as unknown:
        CalculatorEnv.check_params({"tools": "all"})
    assert unknown.value.param == "tools"
    with pytest.raises(ParamError) as bad:
        CalculatorEnv.check_params({"instructions": "m" * 100_000})
    assert bad.value.param == "instructions" and len(str(bad.value)) < 200  # a prefix echoed
    CalculatorEnv.check_params({"instructions": "false"})


def test_episodes_run_in_a_plugin_worker_through_the_entry_point(
    engine_site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", with_path(engine_site)["PYTHONPATH"])
    spec = EnvironmentSpec(name="gsm8k-calculator", maxTurns=3)
    session = EnvironmentSession(spec, PluginHost("test", "environment:gsm8k-calculator", 60.0))
    try:
        ids, starts = session.open([("Tom has 3 boxes of 12.", "36"), ("Two and 2?", "4")])
        assert all("<calc>" in s for s in starts)
        first = session.step([(ids[0], "<calc>3*12</calc>"), (ids[1], "<calc>2**99999999</calc>")])
        assert first[0].observation == "\n<result>36</result>\n"
        assert "error: no powers" in first[1].observation
        second = session.step([(ids[0], "#### 36"), (ids[1], "#### 5")])
        assert [s.done for s in second] == [True, True]
        assert [s.reward for s in second] == [1.0, 0.0]
        session.close_episodes(ids)
    finally:
        session.close()
