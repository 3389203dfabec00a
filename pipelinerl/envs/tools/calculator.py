"""A safe arithmetic evaluator for tool calls: `evaluate("12*(3+4)")` -> "84".

The expression is parsed with `ast` and walked node by node; nothing is ever passed to `eval`. Only number
literals (integers, decimals), parentheses, unary + and -, and the binary operators + - * / // % ** are
accepted; names, calls, attributes, subscripts, strings and comparisons are refused. Arithmetic is exact
(`fractions.Fraction`): `/` divides exactly and `0.1+0.2` is 0.3. Every value's numerator and denominator
stay under MAX_BITS bits, and a power is refused *before* it is computed when its result would not, so a
hostile `9**9**9` costs microseconds. Any refusal raises `CalculatorError` (a ValueError) whose message is
meant for the model.
"""

from __future__ import annotations

import ast
import decimal
import math
import operator
from fractions import Fraction

MAX_LENGTH = 500  # characters of one expression
MAX_NODES = 200  # syntax-tree nodes of one expression
MAX_EXPONENT = 10_000  # |exponent| of a power
MAX_BITS = 4096  # bits of any value's numerator and of its denominator (about 1,233 decimal digits)
SIGNIFICANT_DIGITS = 15  # after the integer part of a non-terminating decimal (1/3 -> 0.333333333333333)

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# Operators Python parses but a calculator does not offer, with what the model probably meant.
_HINTS = {ast.BitXor: "use ** for powers", ast.MatMult: "use * to multiply"}

SPEC_DESCRIPTION = ("Evaluate an arithmetic expression exactly: integers and decimals, parentheses, "
                    "+ - * / // % and ** (integer exponents).")
SPEC_PARAMETERS = {"type": "object", "required": ["expression"],
                   "properties": {"expression": {"type": "string", "description": "for example (12+3)*4/5"}}}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why, for the model."""


def evaluate(expression: str) -> str:
    """The exact value of `expression` as text: an integer, or a decimal (its integer part and
    SIGNIFICANT_DIGITS more digits when it does not terminate). Raises CalculatorError for anything else."""
    return format_value(evaluate_exact(expression))


def evaluate_exact(expression: str) -> Fraction:
    """The exact value of `expression`; raises CalculatorError."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be text, got {type(expression).__name__}")
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"the expression is {len(expression)} characters long; the limit is {MAX_LENGTH}")
    if not expression.strip():
        raise CalculatorError("the expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:  # ValueError: e.g. a NUL byte
        raise CalculatorError(f"not an arithmetic expression: {getattr(e, 'msg', e)}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"the expression has more than {MAX_NODES} parts")
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        return _literal(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        if type(node.op) in _BINARY:
            if right == 0 and not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
                raise CalculatorError("division by zero")
            return _checked(Fraction(_BINARY[type(node.op)](left, right)))  # Fraction // Fraction is an int
        hint = _HINTS.get(type(node.op))
        raise CalculatorError(f"operator {type(node.op).__name__} is not supported" + (f"; {hint}" if hint else ""))
    raise CalculatorError(f"{_describe(node)} is not allowed: only numbers, parentheses and + - * / // % **")


def _literal(value: object) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError(f"{value!r} is not a number")
    if isinstance(value, float):
        if not math.isfinite(value):  # 1e999
            raise CalculatorError("the number is too large")
        # The literal's shortest repr is what the model wrote (0.1 is 1/10, not the nearest binary float).
        return _checked(Fraction(repr(value)))
    return _checked(Fraction(value))


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("exponents must be integers")
    e = exponent.numerator
    if abs(e) > MAX_EXPONENT:
        raise CalculatorError(f"the exponent {e} is too large; the limit is {MAX_EXPONENT}")
    if base == 0 and e < 0:
        raise CalculatorError("division by zero")
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if bits > 1 and (bits - 1) * abs(e) > MAX_BITS:  # a lower bound of the result's size: refuse early
        raise CalculatorError("the result is too large")
    return base**e


def _checked(value: Fraction) -> Fraction:
    if value.numerator.bit_length() > MAX_BITS or value.denominator.bit_length() > MAX_BITS:
        raise CalculatorError("the result is too large")
    return value


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.Attribute):
        return "attribute access"
    return f"a {type(node).__name__} expression"


def format_value(value: Fraction) -> str:
    """An integer as is; otherwise a plain decimal (no exponent), exact if it terminates."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    # A terminating decimal has at most MAX_BITS digits after the point and MAX_BITS before: exact. Any
    # other keeps its whole integer part and SIGNIFICANT_DIGITS more.
    whole = abs(value.numerator) // value.denominator
    digits = 2 * MAX_BITS if den == 1 else SIGNIFICANT_DIGITS + (len(str(whole)) if whole else 0)
    with decimal.localcontext(decimal.Context(prec=digits)):
        text = format(decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text
