"""A calculator for model output: ``+ - * /``, parentheses and numbers, nothing else.

The expression is text a policy wrote, so it is hostile by assumption: it is parsed with
``ast`` and walked (never ``eval``/``exec``), every node not on the allow-list is
refused (names, calls, attributes, ``**``, comparisons...), and the work is bounded before
it starts: at most ``MAX_CHARS`` characters and ``MAX_NODES`` nodes, every number and
every intermediate result within ``MAX_MAGNITUDE`` (so no product chain grows a huge
integer), denominators within ``MAX_DENOMINATOR``. Arithmetic is exact (fractions), so
``0.1*3`` is ``0.3``. A refusal is a ``CalcError`` whose message the environment shows
the policy. Pure.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from fractions import Fraction

from loraplex_engine.spec.errors import CalcError

MAX_CHARS = 200
MAX_NODES = 64
MAX_MAGNITUDE = 10**15
MAX_DENOMINATOR = 10**9
DECIMALS = 6
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_BINARY: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
ALLOWED = "numbers, + - * / and parentheses"


def _number(value: object) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CalcError(f"only {ALLOWED}")
    if isinstance(value, float) and value != value:  # nan cannot be written, but be sure
        raise CalcError("not a number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalcError(f"a number is over {MAX_MAGNITUDE:.0e}")
    return Fraction(str(value)) if isinstance(value, float) else Fraction(value)


def _bounded(value: Fraction) -> Fraction:
    if abs(value) > MAX_MAGNITUDE:
        raise CalcError(f"a result is over {MAX_MAGNITUDE:.0e}")
    if value.denominator > MAX_DENOMINATOR:
        value = value.limit_denominator(MAX_DENOMINATOR)
    return value


def _walk(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        return _number(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _walk(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalcError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        raise CalcError(f"no powers: only {ALLOWED}")
    raise CalcError(f"only {ALLOWED}")


def evaluate(expression: str) -> Fraction:
    """The value of ``expression``; ``CalcError`` saying why when it is refused."""
    text = expression.strip().replace("×", "*").replace("÷", "/")
    text = _THOUSANDS.sub("", text)  # 1,000 is a thousand, not a tuple
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalcError(f"expression over {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError(f"cannot parse: only {ALLOWED}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"expression over {MAX_NODES} terms")
    return _walk(tree.body)


def render(value: Fraction) -> str:
    """An integer as is; anything else as a decimal (``DECIMALS`` places, no trailing 0)."""
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.{DECIMALS}f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def calculate(expression: str) -> str:
    """The tool's answer: the value, or ``error: <why>``."""
    try:
        return render(evaluate(expression))
    except CalcError as e:
        return f"error: {e}"
