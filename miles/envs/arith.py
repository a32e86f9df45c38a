"""A safe arithmetic evaluator built on `ast` (never `eval`): exact rational arithmetic with size limits."""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

MAX_EXPRESSION_CHARS = 256
MAX_MAGNITUDE = 10**64
MAX_EXPONENT = 64


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or it is too large, or it divides by zero."""


_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _check(value: Fraction) -> Fraction:
    if abs(value.numerator) > MAX_MAGNITUDE * max(1, value.denominator) or value.denominator > MAX_MAGNITUDE:
        raise CalculatorError("result is too large")
    return value


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise CalculatorError("division by zero")
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"exponent must be a whole number with |exponent| <= {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise CalculatorError("division by zero")
        return _check(_BINOPS[type(node.op)](left, right))
    raise CalculatorError(f"unsupported syntax: {ast.dump(node)[:60]}")


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression over numbers, + - * / // % ** and parentheses."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    if not expression.strip():
        raise CalculatorError("empty expression")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.msg}") from None
    try:
        return _eval(tree)
    except RecursionError:
        raise CalculatorError("expression is nested too deeply") from None


def format_number(value: Fraction) -> str:
    """Whole numbers print as integers ("11"); others as a decimal with up to 10 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"
