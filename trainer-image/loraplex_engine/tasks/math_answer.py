"""A completion's final answer, read the way GSM8K graders read it. Pure; no sympy.

Completions are tenant-controlled model output: any length, any bytes. Only the tail
(``TAIL_CHARS``) is searched (a final answer is at the end; regexes on megabytes are
time the tick does not have), and an extracted answer is at most ``ANSWER_CHARS`` long.
``risky`` flags what could make a symbolic parser compute for minutes (powers,
factorials): the math-verify reward scores such an answer 0 without parsing it.
"""

from __future__ import annotations

import re
from fractions import Fraction

TAIL_CHARS = 4096
ANSWER_CHARS = 64
_HASHES = re.compile(r"####\s*([^\n]*)")
_BOXED = "\\boxed{"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_RISKY = re.compile(r"\^|\*\*|!|\\exp|\\binom|e\d|E\d")
_PLAIN = re.compile(r"^\$?\s*(-?\d[\d,]*(?:\.\d+)?|-?\d+\s*/\s*\d+)\s*\$?\.?$")


def tail(text: str) -> str:
    return text[-TAIL_CHARS:]


def _boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, min(len(text), i + 4 * ANSWER_CHARS)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(completion: str) -> str | None:
    """The last ``#### x``, else the last ``\\boxed{x}``, else the last number; None when
    there is none. Stripped and cut to ``ANSWER_CHARS``."""
    text = tail(completion)
    found = _HASHES.findall(text)
    answer = found[-1] if found and found[-1].strip() else _boxed(text)
    if answer is None:
        numbers = _NUMBER.findall(text)
        answer = numbers[-1] if numbers else None
    if answer is None or not answer.strip():
        return None
    return answer.strip()[:ANSWER_CHARS]


def gold_answer(answer: str) -> str:
    """The gold answer of a row: the text after GSM8K's last ``####``, else all of it."""
    found = _HASHES.findall(tail(answer))
    return (found[-1] if found else answer).strip()[:ANSWER_CHARS]


def risky(answer: str) -> bool:
    """Could parsing ``answer`` build a huge number (a power, a factorial)?"""
    return bool(_RISKY.search(answer))


def as_number(answer: str) -> Fraction | None:
    """A plain number (``1,000``, ``$18``, ``18.0``, ``-3/4``, a trailing period) as an
    exact fraction; None for anything else."""
    match = _PLAIN.match(answer.strip())
    if not match:
        return None
    text = match.group(1).replace(",", "").replace(" ", "")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def number_matches(completion: str, gold: str) -> bool:
    """The completion's final answer is the gold number (exact; no symbolic algebra)."""
    answer = final_answer(completion)
    if answer is None:
        return False
    want = as_number(gold_answer(gold))
    got = as_number(answer)
    if got is None:  # "18 apples", "$18 dollars": the first number of the answer
        first = _NUMBER.search(answer)
        got = as_number(first.group()) if first else None
    return want is not None and got is not None and got == want
