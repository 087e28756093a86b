"""The ``math-verify`` reward plug-in (entry point ``loraplex.rewards: math-verify``).

A TRL-style reward function: 1.0 when a completion's final answer (``#### x``,
``\\boxed{x}`` or the last number: math_answer.py) equals the gold answer by
Hugging Face's ``math_verify`` (``1,000`` = ``1000``, ``\\frac{36}{2}`` = ``18``,
``18.0`` = ``18``), else 0.0. The gold is a row's ``answer`` column: a number, or a
GSM8K solution ending ``#### n``.

Runs in the experiment's plug-in worker (environments/worker.py), on its main thread, so
math_verify's own signal-based timeouts work. Hostile completions are bounded three
ways: only the tail is searched and the extracted answer is at most 64 characters
(math_answer.py); an answer with a power or a factorial scores 0 unparsed (a big integer
power runs in C, where no signal interrupts it); and each parse and comparison has
``TIMEOUT_S``. The plug-in worker's wall-clock bound (``serve --plugin-timeout``) is the
backstop for anything that still hangs: then the experiment fails, the engine does not.
"""

from __future__ import annotations

from collections.abc import Sequence

from loraplex_engine.tasks.math_answer import final_answer, gold_answer, risky

TIMEOUT_S = 1  # per parse and per comparison (math_verify takes whole seconds)


def _parse(text: str) -> list:
    from math_verify import parse  # imported in the worker, never by the engine

    return parse(text, parsing_timeout=TIMEOUT_S)


def score_one(completion: str, gold: str) -> float:
    """1.0 when the completion's final answer verifies against ``gold``, else 0.0."""
    from math_verify import verify

    answer = final_answer(completion)
    if answer is None or risky(answer):
        return 0.0
    want = gold_answer(gold)
    if risky(want):
        return 0.0
    # \boxed{} makes math_verify read the answer as LaTeX or as a plain expression alike.
    got, expected = _parse(f"\\boxed{{{answer}}}"), _parse(f"\\boxed{{{want}}}")
    if not got or not expected:
        return 0.0
    return 1.0 if verify(expected, got, timeout_seconds=TIMEOUT_S) else 0.0


def math_verify_reward(
    prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **columns: object
) -> list[float]:
    """TRL's reward-function convention: one score per completion."""
    return [score_one(c, a) for c, a in zip(completions, answer, strict=True)]
