"""The built-in ``calculator`` tool: sandboxed arithmetic over Python expression syntax, never ``eval``.

The expression is parsed with :mod:`ast` and walked twice: first every node is checked against a
whitelist (int/float literals, ``+ - * / // % **``, unary ``+ -``, parentheses, and calls of ``abs``,
``min``, ``max``, ``round``, ``sqrt`` with positional arguments), so that names, attribute access
(``().__class__``), subscripts, lambdas, comprehensions, strings and calls of anything else are refused
before anything is computed; then the tree is evaluated with Python's own operators, so results follow
Python's arithmetic exactly (int stays int, ``/`` gives a float, ``-7 // 2 == -4``).

Limits, all checked *before* the costly operation: the expression's length; the magnitude of every
literal and intermediate result (``|x| <= 10**max_exponent10``), which bounds every operand, and a
power's result size is estimated from ``exponent * log10(|base|)`` before ``**`` runs (so ``9**9**9``
and ``10**100000`` are refused in microseconds); ``round``'s digit count; and a wall-clock deadline
checked at every node. Refusals raise :class:`~megarlhf.envs.api.ToolError`, whose message the model
reads as ``"error: ..."``. Integers print exactly, floats with 12 significant digits (``0.1 + 0.2`` reads
``0.3``). asteval, simpleeval and numexpr offer far more than arithmetic, or are not in the lock.
"""
from __future__ import annotations

import ast
import math
import operator
import time
from dataclasses import dataclass
from typing import Any, Callable

from megarlhf.envs.api import ENVIRONMENTS, ToolEpisode, ToolError, ToolSpec, stateless

Number = int | float

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"abs": (1, 1), "max": (2, None), "min": (2, None), "round": (1, 2), "sqrt": (1, 1)}  # arg counts
_FUNCTION_NAMES = ", ".join(_FUNCTIONS)
_ALLOWED = f"numbers, + - * / // % **, parentheses and the functions {_FUNCTION_NAMES}"
_MAX_NDIGITS = 100  # round(x, n): |n| bound (round(int, -n) computes 10**n)
_REFUSED = {  # node types with a message of their own; any other node type gets a generic one
    ast.Attribute: "attribute access is not allowed", ast.Subscript: "subscripts are not allowed",
    ast.Lambda: "lambdas are not allowed", ast.ListComp: "comprehensions are not allowed",
    ast.SetComp: "comprehensions are not allowed", ast.DictComp: "comprehensions are not allowed",
    ast.GeneratorExp: "comprehensions are not allowed", ast.JoinedStr: "strings are not allowed",
    ast.Compare: "comparisons are not allowed", ast.BoolOp: "'and' / 'or' are not allowed",
    ast.IfExp: "conditional expressions are not allowed", ast.NamedExpr: "assignments are not allowed",
}


_FLOAT_RANGE = "a value is too large for a floating-point number (beyond about 1.8e308)"

# Upper bounds of the limits a recipe may set (rollout.env.kwargs): results are printed, and Python refuses
# to print integers of more than 4300 digits; the bound itself (10**max_exponent10) is computed per call.
MAX_EXPONENT10, MAX_CHARS, MAX_TIME_LIMIT_S = 4000, 100_000, 60.0


@dataclass(frozen=True)
class CalculatorLimits:
    max_chars: int = 500  # expression length
    max_exponent10: int = 100  # every literal, intermediate and final result has |x| <= 10**max_exponent10
    time_limit_s: float = 0.5  # wall clock, checked at every node

    def __post_init__(self):
        for name, top in (("max_chars", MAX_CHARS), ("max_exponent10", MAX_EXPONENT10)):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= top):
                raise ValueError(f"calculator {name} must be an int in [1, {top}], got {value!r}")
        value = self.time_limit_s
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and 0 < value <= MAX_TIME_LIMIT_S):
            raise ValueError(f"calculator time_limit_s must be a finite number in (0, {MAX_TIME_LIMIT_S:g}], "
                             f"got {value!r}")


def _check_syntax(node: ast.AST) -> None:
    """Raises ToolError at the first node outside the whitelist (nothing is computed here)."""
    if isinstance(node, ast.Expression):
        return _check_syntax(node.body)
    if isinstance(node, ast.Constant):
        if type(node.value) in (int, float):
            return None
        if isinstance(node.value, (str, bytes)):
            raise ToolError("strings are not allowed")
        raise ToolError(f"the constant {node.value!r} is not allowed; use {_ALLOWED}")
    if isinstance(node, ast.BinOp):
        if type(node.op) not in _BINARY:
            raise ToolError(f"the operator {type(node.op).__name__} is not allowed; use {_ALLOWED}")
        _check_syntax(node.left)
        return _check_syntax(node.right)
    if isinstance(node, ast.UnaryOp):
        if type(node.op) not in _UNARY:
            raise ToolError(f"the operator {type(node.op).__name__} is not allowed; use {_ALLOWED}")
        return _check_syntax(node.operand)
    if isinstance(node, ast.Call):
        return _check_call(node)
    if isinstance(node, ast.Name):
        raise ToolError(f"names are not allowed ({node.id!r}); use {_ALLOWED}")
    raise ToolError(_REFUSED.get(type(node), f"{type(node).__name__} is not allowed; use {_ALLOWED}"))


def _check_call(node: ast.Call) -> None:
    if not isinstance(node.func, ast.Name):
        _check_syntax(node.func)  # reports lambdas, attributes, ... by their own message
        raise ToolError(f"only the functions {_FUNCTION_NAMES} can be called")
    name = node.func.id
    if name not in _FUNCTIONS:
        raise ToolError(f"calling {name!r} is not allowed; the functions are {_FUNCTION_NAMES}")
    if node.keywords:
        raise ToolError(f"{name}() takes positional arguments only")
    low, high = _FUNCTIONS[name]
    if any(isinstance(a, ast.Starred) for a in node.args):
        raise ToolError(f"{name}() takes plain arguments, not *starred ones")
    if len(node.args) < low or (high is not None and len(node.args) > high):
        wanted = str(low) if low == high else f"{low} or more" if high is None else f"{low} to {high}"
        raise ToolError(f"{name}() takes {wanted} argument{'' if wanted == '1' else 's'}, got {len(node.args)}")
    for arg in node.args:
        _check_syntax(arg)


class _Evaluator:
    """Evaluates a checked tree, bounding every value (see the module docstring)."""

    def __init__(self, limits: CalculatorLimits):
        self.limits = limits
        self.bound = 10 ** limits.max_exponent10
        self.deadline = time.monotonic() + limits.time_limit_s

    def checked(self, value: Any) -> Number:
        if isinstance(value, complex):
            raise ToolError("the result is not a real number")
        if isinstance(value, float) and math.isnan(value):
            raise ToolError("the result is not a number (nan)")
        if (isinstance(value, float) and math.isinf(value)) or abs(value) > self.bound:
            raise ToolError(f"a value exceeds 10**{self.limits.max_exponent10} in magnitude")
        return value

    def value(self, node: ast.AST) -> Number:
        if time.monotonic() > self.deadline:
            raise ToolError(f"the calculation took longer than {self.limits.time_limit_s} s")
        if isinstance(node, ast.Constant):
            return self.checked(node.value)
        if isinstance(node, ast.UnaryOp):
            return self.checked(_UNARY[type(node.op)](self.value(node.operand)))
        if isinstance(node, ast.BinOp):
            left, right = self.value(node.left), self.value(node.right)
            return self.binary(type(node.op), left, right)
        if isinstance(node, ast.Call):
            return self.call(node.func.id, [self.value(a) for a in node.args])
        raise ToolError(f"{type(node).__name__} is not allowed")  # unreachable after _check_syntax

    def binary(self, op: type, left: Number, right: Number) -> Number:
        if op is ast.Pow and left != 0:
            # log10 of the result's magnitude, known before computing it
            if right * math.log10(abs(left)) > self.limits.max_exponent10 + 1:
                raise ToolError(f"the power would exceed 10**{self.limits.max_exponent10} in magnitude")
        try:
            return self.checked(_BINARY[op](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:  # an int past the float range met a float (or a true division)
            raise ToolError(_FLOAT_RANGE) from None

    def call(self, name: str, args: list[Number]) -> Number:
        try:
            return self._call(name, args)
        except OverflowError:  # sqrt of an int past the float range (max_exponent10 > 308)
            raise ToolError(_FLOAT_RANGE) from None

    def _call(self, name: str, args: list[Number]) -> Number:
        if name == "sqrt":
            if args[0] < 0:
                raise ToolError("sqrt of a negative number")
            return self.checked(math.sqrt(args[0]))
        if name == "round" and len(args) == 2:
            if not isinstance(args[1], int):
                raise ToolError("round()'s second argument (the number of digits) must be an integer")
            if abs(args[1]) > _MAX_NDIGITS:
                raise ToolError(f"round()'s number of digits must be between -{_MAX_NDIGITS} and {_MAX_NDIGITS}")
        function = {"abs": abs, "max": max, "min": min, "round": round}[name]
        return self.checked(function(*args))


def evaluate(expression: Any, limits: CalculatorLimits = CalculatorLimits()) -> Number:
    """The value of ``expression`` (an int or a float); raises ToolError with a message for the model."""
    if not isinstance(expression, str):
        raise ToolError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > limits.max_chars:
        raise ToolError(f"the expression has {len(expression)} characters; the limit is {limits.max_chars}")
    if not expression.strip():
        raise ToolError("the expression is empty")
    evaluator = _Evaluator(limits)
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        _check_syntax(tree)
        return evaluator.value(tree.body)
    except SyntaxError as exc:
        raise ToolError(f"not a valid expression: {exc.msg}") from None
    except ValueError as exc:  # e.g. a null byte in the source
        raise ToolError(f"not a valid expression: {exc}") from None
    except (RecursionError, MemoryError):  # Python's parser gives up on deep nesting with either
        raise ToolError("the expression is nested too deeply") from None


def format_number(value: Number) -> str:
    """Integers exactly; floats with 12 significant digits (no binary noise such as 0.30000000000000004)."""
    if isinstance(value, int):
        return str(value)
    return "0" if value == 0 else format(value, ".12g")


def calculate(expression: Any, limits: CalculatorLimits = CalculatorLimits()) -> str:
    """The calculator tool: ``expression`` -> its value as text (raises ToolError on refusal)."""
    return format_number(evaluate(expression, limits))


CALCULATOR_TOOL = ToolSpec(
    name="calculator",
    description=f"Evaluates an arithmetic expression and returns its value. Allowed: {_ALLOWED}.",
    parameters={"type": "object", "required": ["expression"],
                "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2 ** 10"}}},
)


@ENVIRONMENTS.register("calculator")
@stateless
def calculator_env(metadata: dict, max_chars: int = 500, max_exponent10: int = 100,
                   time_limit_s: float = 0.5) -> ToolEpisode:
    """A stateless episode with one tool, ``calculator(expression)``; kwargs set the limits."""
    limits = CalculatorLimits(max_chars, max_exponent10, time_limit_s)
    return ToolEpisode([CALCULATOR_TOOL], {"calculator": lambda expression: calculate(expression, limits)})
