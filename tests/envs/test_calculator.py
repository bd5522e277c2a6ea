"""The calculator against Python's own arithmetic on random expressions built here (the reference value is
computed with plain operators while the text is written), hand-worked precedence cases, and the refusals
(each with its message, each in well under 0.1 s)."""
from __future__ import annotations

import math
import operator
import random
import time

import pytest

from megarlhf.envs import ENVIRONMENTS, CalculatorLimits, ParsedCall, StepResult, ToolError, calculate, evaluate

BOUND = 10 ** 100  # the default limit on every value


class Refused(Exception):
    """The reference's verdict that the calculator must refuse (kind: 'zero' or 'range')."""


def _bounded(value):
    if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)) or abs(value) > BOUND:
        raise Refused("range")
    return value


def _apply(fn, *args):
    try:
        return _bounded(fn(*args))
    except ZeroDivisionError:
        raise Refused("zero") from None
    except OverflowError:
        raise Refused("range") from None


def _literal(rng: random.Random):
    """(text, value) of a number literal; negatives parenthesized so the text means what the value is."""
    value = rng.randint(-30, 30) if rng.random() < 0.7 else round(rng.uniform(-12, 12), rng.randint(0, 4))
    return (f"({value!r})" if value < 0 else repr(value)), value


_BINARY = [("+", operator.add), ("-", operator.sub), ("*", operator.mul), ("/", operator.truediv),
           ("//", operator.floordiv), ("%", operator.mod)]


def _expression(rng: random.Random, depth: int):
    """(text, thunk): the thunk computes the value with Python operators, bounding every intermediate
    value like the calculator is specified to, and raises Refused where the calculator must refuse."""
    if depth == 0 or rng.random() < 0.25:
        text, value = _literal(rng)
        return text, lambda: value
    kind = rng.random()
    if kind < 0.55:
        symbol, fn = rng.choice(_BINARY)
        (lt, lf), (rt, rf) = _expression(rng, depth - 1), _expression(rng, depth - 1)
        return f"({lt} {symbol} {rt})", lambda: _apply(fn, lf(), rf())
    if kind < 0.7:  # small exponents keep the reference itself cheap; nesting still crosses the bound
        (bt, bf) = _expression(rng, depth - 1)
        exponent = rng.choice([0, 1, 2, 3, 4, -1, -2, 0.5, 1.5])
        return f"({bt}) ** {exponent!r}", lambda: _apply(operator.pow, bf(), exponent)
    if kind < 0.78:
        (at, af) = _expression(rng, depth - 1)
        return f"-({at})", lambda: _apply(operator.neg, af())
    name = rng.choice(["abs", "min", "max", "round", "round2"])
    if name in ("abs", "round"):
        (at, af) = _expression(rng, depth - 1)
        return f"{name}({at})", lambda: _apply({"abs": abs, "round": round}[name], af())
    if name == "round2":
        (at, af), digits = _expression(rng, depth - 1), rng.randint(-2, 3)
        return f"round({at}, {digits})", lambda: _apply(round, af(), digits)
    parts = [_expression(rng, depth - 1) for _ in range(rng.randint(2, 3))]
    fn = min if name == "min" else max
    return f"{name}({', '.join(t for t, _ in parts)})", lambda: _apply(fn, *[f() for _, f in parts])


def test_random_expressions_match_python():
    rng = random.Random(1234)
    counts = {"value": 0, "zero": 0, "range": 0}
    for _ in range(400):
        text, thunk = _expression(rng, rng.randint(1, 4))
        try:
            want = thunk()
        except Refused as refusal:
            counts[str(refusal)] += 1
            with pytest.raises(ToolError) as info:
                evaluate(text)
            if str(refusal) == "zero":
                assert str(info.value) == "division by zero", text
            else:
                assert "10**100 in magnitude" in str(info.value) or str(info.value) == "the result is not a real number"
            continue
        counts["value"] += 1
        got = evaluate(text)
        # same operators in the same order: the same value and type, bit for bit
        assert type(got) is type(want) and got == want, (text, got, want)
        shown = calculate(text)
        if isinstance(want, int):
            assert shown == str(want), text
        else:
            assert math.isclose(float(shown), want, rel_tol=1e-11), (text, shown, want)
    assert counts["value"] > 250 and counts["zero"] > 5 and counts["range"] > 0, counts


@pytest.mark.parametrize("text, shown", [
    ("2+3*4", "14"), ("2**3**2", "512"), ("-2**2", "-4"), ("(-2)**2", "4"), ("7-3-2", "2"), ("100/10/5", "2"),
    ("-7//2", "-4"), ("-7 % 3", "2"), ("7 % -3", "-2"), ("2*3**2", "18"), ("2**-1", "0.5"),
    ("abs(-3) + max(1, 2, 3) * min(4, 5)", "15"), ("round(2.5)", "2"), ("round(3.5)", "4"), ("round(2.675, 2)", "2.67"),
    ("sqrt(16)", "4"), ("1_000 + 0x10", "1016"), ("10**100", "1" + "0" * 100), ("-10**100", "-1" + "0" * 100),
    ("0.1 + 0.2", "0.3"), ("1/3", "0.333333333333"), ("2**0.5", "1.41421356237"), ("1e20", "1e+20"),
    ("-0.0", "0"), ("  +5 ", "5"), ("123456789 * 987654321", "121932631112635269"), ("round(1234, -2)", "1200"),
])
def test_hand_worked(text, shown):
    assert calculate(text) == shown


REFUSALS = [
    ("__import__('os')", "calling '__import__' is not allowed; the functions are abs, max, min, round, sqrt"),
    ("().__class__.__bases__", "attribute access is not allowed"),
    ("(1).real", "attribute access is not allowed"),
    ("open('x')", "calling 'open' is not allowed; the functions are abs, max, min, round, sqrt"),
    ("9**9**9", "the power would exceed 10**100 in magnitude"),
    ("10**100000", "the power would exceed 10**100 in magnitude"),
    ("2 ** 1000", "the power would exceed 10**100 in magnitude"),
    ("0.5 ** -1000", "the power would exceed 10**100 in magnitude"),
    ("10**50 * 10**51", "a value exceeds 10**100 in magnitude"),
    ("1e200", "a value exceeds 10**100 in magnitude"),
    ("1e999 - 1e999", "a value exceeds 10**100 in magnitude"),
    ("1+" * 5000 + "1", "the expression has 10001 characters; the limit is 500"),
    ("lambda: 1", "lambdas are not allowed"),
    ("(lambda x: x)(2)", "lambdas are not allowed"),
    ("x", "names are not allowed ('x'); use numbers, + - * / // % **, parentheses and the functions abs, max, "
          "min, round, sqrt"),
    ("pi * 2", "names are not allowed ('pi')"),
    ("'abc'", "strings are not allowed"),
    ("f'{1}'", "strings are not allowed"),
    ("[x for x in (1, 2)]", "comprehensions are not allowed"),
    ("(1, 2)[0]", "subscripts are not allowed"),
    ("1 < 2", "comparisons are not allowed"),
    ("1 and 2", "'and' / 'or' are not allowed"),
    ("(y := 2)", "assignments are not allowed"),
    ("2 << 3", "the operator LShift is not allowed"),
    ("~1", "the operator Invert is not allowed"),
    ("1j", "the constant 1j is not allowed"),
    ("True + 1", "the constant True is not allowed"),
    ("abs(-3, 2)", "abs() takes 1 argument, got 2"),
    ("max(1)", "max() takes 2 or more arguments, got 1"),
    ("round(1.5, ndigits=1)", "round() takes positional arguments only"),
    ("max(*(1, 2))", "max() takes plain arguments, not *starred ones"),
    ("round(1.5, 1.0)", "round()'s second argument (the number of digits) must be an integer"),
    ("round(1, 10**6)", "round()'s number of digits must be between -100 and 100"),
    ("1/0", "division by zero"), ("5 % 0", "division by zero"), ("0 ** -1", "division by zero"),
    ("5.0 // 0.0", "division by zero"),
    ("sqrt(-1)", "sqrt of a negative number"),
    ("(-8) ** (1/3)", "the result is not a real number"),
    ("1 +", "not a valid expression: invalid syntax"),
    ("import os", "not a valid expression: invalid syntax"),
    ("   ", "the expression is empty"),
    (12, "the expression must be a string, got int"),
]


@pytest.mark.parametrize("text, message", REFUSALS, ids=[str(t)[:30] for t, _ in REFUSALS])
def test_refusals_are_clear_and_quick(text, message):
    start = time.perf_counter()
    with pytest.raises(ToolError) as info:
        evaluate(text)
    elapsed = time.perf_counter() - start
    assert str(info.value).startswith(message), str(info.value)
    assert elapsed < 0.1, f"{text!r} took {elapsed:.3f} s"


def test_limits():
    wide = CalculatorLimits(max_chars=100_000)
    with pytest.raises(ToolError, match="^not a valid expression: too many nested parentheses$"):
        evaluate("(" * 300 + "1" + ")" * 300, wide)
    with pytest.raises(ToolError, match=r"^the calculation took longer than 1e-09 s$"):
        evaluate("1+2+3", CalculatorLimits(time_limit_s=1e-9))
    assert evaluate("10**20", CalculatorLimits(max_exponent10=20)) == 10 ** 20
    with pytest.raises(ToolError, match=r"^a value exceeds 10\*\*20 in magnitude$"):
        evaluate("10**20 + 1", CalculatorLimits(max_exponent10=20))
    past_floats = CalculatorLimits(max_exponent10=500)  # ints beyond the float range, which float operations refuse
    for text in ("sqrt(10**400)", "10**400 / 3", "10**400 + 0.5", "max(10**400, 0.5) * 1.5"):
        with pytest.raises(ToolError, match=r"^a value is too large for a floating-point number"):
            evaluate(text, past_floats)
    assert evaluate("10**400 // 7", past_floats) == 10**400 // 7 and evaluate("sqrt(10**300)", past_floats) == 1e150
    with pytest.raises(ValueError, match=r"calculator max_chars must be an int in \[1, 100000\], got 0"):
        CalculatorLimits(max_chars=0)
    start = time.perf_counter()
    assert evaluate("-" * 499 + "1") == -1  # the deepest tree the default length allows
    assert time.perf_counter() - start < 0.1


def test_calculator_environment():
    episode = ENVIRONMENTS.get("calculator")({}, max_exponent10=10)
    assert [spec.name for spec in episode.tools] == ["calculator"]
    assert episode.tools[0].required == ["expression"]
    assert episode.step([], ParsedCall("calculator", {"expression": "6 * 7"})) == StepResult("42")
    assert episode.step([], ParsedCall("calculator", {"expression": "10**12"})) == StepResult(
        "error: the power would exceed 10**10 in magnitude",
        info={"tool_error": "the power would exceed 10**10 in magnitude"})


@pytest.mark.parametrize("limits, message", [
    (dict(max_exponent10=10**7), r"max_exponent10 must be an int in \[1, 4000\]"),
    (dict(max_chars=10**9), r"max_chars must be an int in \[1, 100000\]"),
    (dict(time_limit_s=float("inf")), r"time_limit_s must be a finite number in \(0, 60\]"),
])
def test_limits_set_through_kwargs_are_bounded(limits, message):
    """Limits come from the recipe (rollout.env.kwargs): a huge exponent bound made every call compute
    10**(10**7) (10 s) and a result past Python's 4300-digit str limit raise ValueError."""
    with pytest.raises(ValueError, match=message):
        CalculatorLimits(**limits)
    with pytest.raises(ValueError, match=message):
        ENVIRONMENTS.get("calculator")({}, **limits)


def test_deep_unary_nesting_is_a_tool_error():
    """Python's parser answers 20000 nested unary minuses with MemoryError (not RecursionError)."""
    with pytest.raises(ToolError, match="nested too deeply"):
        calculate("-" * 20000 + "1", CalculatorLimits(max_chars=100_000))
