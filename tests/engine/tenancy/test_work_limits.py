"""What a step and a completion may cost (tenancy/work_limits.py), checked directly: each limit
refuses one token over it, naming the field and the flag, and admits the work at it."""

from __future__ import annotations

import pytest
from loraplex_engine.spec.errors import InvalidRequestError, InvalidSpecError
from loraplex_engine.tenancy.work_limits import WorkLimits

from tests.support.engine_builders import spec

# 8 rows (groupSize 2 x promptsPerStep 4) x (100 prompt + 8 new tokens) = 864 tokens
LIMITS = WorkLimits(max_prompt_tokens=100, max_step_tokens=864, context_tokens=128)


def test_a_step_at_the_limit_is_admitted_and_one_over_is_refused() -> None:
    LIMITS.check_step(spec(group=2, prompts=4))
    with pytest.raises(InvalidSpecError) as e:
        WorkLimits(100, 863, 128).check_step(spec(group=2, prompts=4))
    assert e.value.field == "spec.algorithm.promptsPerStep"
    assert "864 tokens per step exceeds this engine's limit of 863" in str(e.value)
    with pytest.raises(InvalidSpecError) as e:
        WorkLimits(100, 10**6, 8).check_step(spec(group=2, prompts=4))  # context 8 = new
    assert e.value.field == "spec.rollout.maxNewTokens"
    WorkLimits(100, 864, None).check_step(spec(group=2, prompts=4))  # no context stated


def test_a_row_costs_at_most_the_context() -> None:
    """A context of 50 holds no row over 50 tokens (longer prompts are refused at rollout),
    so 8 rows cost 400 tokens, not 8 x (100 + 8)."""
    WorkLimits(100, 400, 50).check_step(spec(group=2, prompts=4))
    with pytest.raises(InvalidSpecError, match="= 400 tokens per step exceeds"):
        WorkLimits(100, 399, 50).check_step(spec(group=2, prompts=4))


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "n", "field"),
    [(101, 1, 1, "prompt"), (100, 29, 1, "max_tokens"), (60, 60, 8, "n")],
)
def test_a_completion_over_a_limit_names_its_field(prompt, max_tokens, n, field) -> None:
    with pytest.raises(InvalidRequestError) as e:
        LIMITS.check_completion(prompt, max_tokens, n)
    assert e.value.field == field


def test_a_completion_at_every_limit_is_admitted() -> None:
    LIMITS.check_completion(100, 28, 1)  # the whole context
    LIMITS.check_completion(54, 54, 8)  # 8 x 108 = 864: the step limit
