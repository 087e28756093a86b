"""The multi-turn GSM8K variant: a calculator tool behind our environment interface
(environments/base.py; entry point ``loraplex.environments: gsm8k-calculator``).

Each turn the policy either calls the tool, ``<calc>12*7+3</calc>``, and gets
``<result>87</result>`` back as the next observation (masked out of the loss), or
answers: a turn with a ``####`` answer line, or without a tool call, ends the episode,
scored 1 when its final answer verifies against the task's answer by the math-verify
reward (math_reward.py), else 0.
The engine cuts an episode at ``maxTurns`` (scored by its turns so far: 0 here, since
only an answer scores). Params (strings): ``instructions`` ("true": the first text
explains the tool). The calculator refuses anything but arithmetic (calculator.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from loraplex_engine.environments.base import Environment, ParamError, Step
from loraplex_engine.spec.echo import clip
from loraplex_engine.workloads.calculator import calculate
from loraplex_engine.workloads.math_reward import score_one

PARAMS = {"instructions": "true"}
INSTRUCTIONS = (
    "\nYou may use a calculator: write <calc>expression</calc> (numbers, + - * / and "
    "parentheses) and wait for its <result>. When you know the answer, write it after ####."
)
HEAD_CHARS = 8192  # a tool call is looked for in the turn's first 8 KiB
_CALL = re.compile(r"<calc>(.*?)(</calc>|$)", re.S)


def tool_call(action: str) -> tuple[str, bool] | None:
    """The first ``<calc>`` of a turn: (its expression, whether it was closed); None when
    the turn calls no tool. A turn cut off inside the tag counts as a call."""
    match = _CALL.search(action[:HEAD_CHARS])
    if match is None:
        return None
    return match.group(1), bool(match.group(2))


def parse_params(params: Mapping[str, str]) -> dict[str, str]:
    """The defaults merged with ``params``; a ``ParamError`` naming the first bad one."""
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise ParamError(unknown[0], f"unknown param; known: {', '.join(sorted(PARAMS))}")
    merged = {**PARAMS, **params}
    if merged["instructions"] not in ("true", "false"):
        shown = clip(merged["instructions"])
        raise ParamError("instructions", f"must be true or false, not {shown!r}")
    return merged


class CalculatorEnv(Environment):
    def __init__(self, prompt: str, answer: str, params: Mapping[str, str], max_turns: int):
        super().__init__(prompt, answer, parse_params(params), max_turns)
        self.calls = 0

    @classmethod
    def check_params(cls, params: Mapping[str, str]) -> None:
        """At PUT: an unknown or bad param is the PUT's 422, not the first step's failure."""
        parse_params(params)

    def start(self) -> str:
        return self.prompt + (INSTRUCTIONS if self.params["instructions"] == "true" else "")

    def step(self, action: str) -> Step:
        call = tool_call(action)
        if call is None or "####" in action:
            return Step(reward=score_one(action, self.answer), done=True)
        expression, closed = call
        self.calls += 1
        result = calculate(expression) if closed else "error: no </calc>"
        return Step(observation=f"\n<result>{result}</result>\n", tool_calls=1)
