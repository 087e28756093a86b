"""A multi-turn environment behind loraplex's own interface, with a calculator tool: the
policy may write ``calc: 12 * 7`` and gets the result back as the next observation; an
``answer: N`` ends the episode, scored 1 when N is the task's answer."""

from __future__ import annotations

import ast
import operator

from loraplex_engine.environments.base import Environment, Step

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """+, - and * over integers (no eval: the expression is the policy's text)."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError("only integers with + - *")

    if len(expression) > 64:
        raise ValueError("too long")
    return walk(ast.parse(expression, mode="eval").body)


class CalculatorEnv(Environment):
    def step(self, action: str) -> Step:
        text = action.strip()
        if text.startswith("answer:"):
            given = text.removeprefix("answer:").strip().split()[:1]
            return Step(reward=float(given == [self.answer.strip()]), done=True)
        if text.startswith("calc:"):
            try:
                result = str(evaluate(text.removeprefix("calc:").strip()))
            except (ValueError, SyntaxError, RecursionError):
                result = "error"
            return Step(observation=f"\nresult: {result}\n", tool_calls=1)
        return Step(observation="\nwrite calc: EXPR or answer: N\n")
