"""Final-answer extraction and the rule-based checkers on hand-written cases."""
from __future__ import annotations

from fractions import Fraction

import pytest

from megarlhf.rewards import REWARDS, RewardInput, extract_final_answer, parse_number


@pytest.mark.parametrize("text, answer", [
    ("so the result is \\boxed{1/2}", "1/2"),
    ("\\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
    ("work...\n#### 42", "42"),
    ("The answer is 42.", "42"),
    ("the final answer is: $1,234$.", "1,234"),
    ("The answer is 3. Wait, no.\n#### 5", "5"),  # the last marker wins
    ("#### 5\nActually the answer is 6.", "6"),
    ("no marker here 17", None),
])
def test_extract_final_answer(text, answer):
    assert extract_final_answer(text) == answer


def test_parse_number():
    assert parse_number("1,234") == 1234
    assert parse_number("$5.50") == Fraction(11, 2)
    assert parse_number("3/4") == Fraction(3, 4)
    assert parse_number("50%") == 50
    assert parse_number("abc") is None and parse_number("1/0") is None


# (response, ground truth, exact_match, numeric, math_verify)
CASES = [
    ("so \\boxed{1/2}", "0.5", 0.0, 1.0, 1.0),
    ("#### 42", "42", 1.0, 1.0, 1.0),
    ("Tom has 19. The answer is 42.", "42", 1.0, 1.0, 1.0),
    ("The answer is 41.", "42", 0.0, 0.0, 0.0),
    ("#### 43", "42", 0.0, 0.0, 0.0),
    ("\\boxed{\\frac{1}{2}}", "1/2", 0.0, 0.0, 1.0),
    ("#### 1,234", "1234", 1.0, 1.0, 1.0),
    ("The answer is 2.0", "2", 0.0, 1.0, 1.0),
    ("no answer given", "7", 0.0, 0.0, 0.0),
    # the question's expression restated is not a stated answer (math-verify alone scores these 1.0)
    ("The answer is 97 + 71.", "168", 0.0, 0.0, 0.0),
    ("\\boxed{97+71}", "168", 0.0, 0.0, 0.0),
    ("97 + 71 = 168. The answer is **168**", "168", 0.0, 0.0, 1.0),
    ("The answer is $-\\frac{3}{4}$", "-3/4", 0.0, 0.0, 1.0),
]


@pytest.mark.parametrize("response, truth, exact, num, mv", CASES)
def test_checkers(response, truth, exact, num, mv):
    sample = RewardInput(prompt="q", response=response, ground_truth=truth)
    assert REWARDS.get("exact_match")(sample) == exact
    assert REWARDS.get("numeric")(sample) == num
    assert REWARDS.get("math_verify")(sample) == mv


def test_math_verify_require_number_off_accepts_an_equal_expression():
    sample = RewardInput("What is 97 + 71?", "The answer is 97 + 71.", "168")
    assert REWARDS.get("math_verify")(sample, require_number=False) == 1.0
    # a symbolic ground truth is not a number: an equivalent expression is still a valid answer
    assert REWARDS.get("math_verify")(RewardInput("q", "\\boxed{2\\sqrt{2}}", "\\sqrt{8}")) == 1.0


def test_numeric_tolerance_and_missing_truth():
    sample = RewardInput("q", "The answer is 3.1416", "3.14159")
    assert REWARDS.get("numeric")(sample) == 0.0
    assert REWARDS.get("numeric")(sample, rel_tol=1e-4) == 1.0
    for name in ("exact_match", "numeric", "math_verify"):
        assert REWARDS.get(name)(RewardInput("q", "#### 3", None)) == 0.0
