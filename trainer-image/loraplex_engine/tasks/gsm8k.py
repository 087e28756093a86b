"""The ``gsm8k`` task: generated GSM8K-style word problems (tasks/gsm8k_problems.py).

Default reward: the completion's final answer (``#### n``, ``\\boxed{n}`` or the last
number) is the problem's integer answer, exactly (tasks/math_answer.py; no sympy in
the engine's process). ``task.reward: math-verify`` scores with the math-verify plug-in
instead (symbolic equivalence, in the experiment's plug-in worker).
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from loraplex_engine.spec.errors import TaskError
from loraplex_engine.tasks.base import Prompt, Task, bool_param, int_param
from loraplex_engine.tasks.gsm8k_problems import generate
from loraplex_engine.tasks.math_answer import number_matches

HINT = " Give the final answer as a number after ####."
MAX_STEPS = 8


class Gsm8kTask(Task):
    """``minSteps``..``maxSteps`` arithmetic steps a problem, numbers up to ``maxNumber``;
    ``hint: "true"`` asks for GSM8K's ``#### n`` answer line."""

    name = "gsm8k"
    PARAMS: Mapping[str, str] = {
        "minSteps": "1",
        "maxSteps": "3",
        "maxNumber": "50",
        "hint": "true",
    }

    @classmethod
    def check_params(cls, params: Mapping[str, str]) -> None:
        lo = int_param(params, "minSteps", 1, MAX_STEPS)
        hi = int_param(params, "maxSteps", 1, MAX_STEPS)
        if lo > hi:
            raise TaskError("spec.task.params.minSteps", f"must be <= maxSteps ({hi}), got {lo}")
        int_param(params, "maxNumber", 2, 10_000)
        bool_param(params, "hint")

    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]:
        lo = int_param(self.params, "minSteps", 1, MAX_STEPS)
        hi = int_param(self.params, "maxSteps", 1, MAX_STEPS)
        top = int_param(self.params, "maxNumber", 2, 10_000)
        hint = HINT if bool_param(self.params, "hint") else ""
        out = []
        for _ in range(n):
            problem = generate(rng, lo, hi, top)
            out.append(Prompt(text=problem.question + hint, answer=str(problem.answer)))
        return out

    def verify(self, completion: str, answer: str) -> float:
        return 1.0 if number_matches(completion, answer) else 0.0
