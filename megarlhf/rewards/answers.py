"""Rule-based answer checkers: final-answer extraction, exact match, numeric match, math-verify.

Registered rewards (signature in ``api.py``; each returns 1.0 for a correct answer, else 0.0):

* ``exact_match``: the extracted final answer equals the ground truth after light normalisation
  (whitespace, surrounding ``$``, a trailing period, thousands separators).
* ``numeric``: both parse as numbers (integers, decimals, ``a/b``, thousands separators, ``$``/``%``
  stripped) and agree within ``rel_tol`` / ``abs_tol`` (kwargs).
* ``math_verify``: HF ``math-verify`` parses the response and the ground truth (LaTeX, ``\\boxed{}``,
  plain numbers, "The final answer is ...") and checks mathematical equivalence. Its built-in timeouts
  use ``signal.alarm``, which fails off the main thread, so they are disabled here and the runner
  bounds each call's time instead. When the ground truth is a number, the stated answer must be a number
  too (``require_number``, on by default): math-verify alone judges "The answer is 97 + 71" equal to 168,
  so a policy that restates the question's expression collects full reward. SmolLM2-135M-Instruct did
  exactly that under GRPO on two-digit sums (100% "accuracy" by step 30, responses of ~11 tokens).

The final answer of a response is the last occurrence of any of ``\\boxed{X}``, ``#### X`` or
``The (final) answer is X`` (the formats of the project's synthetic tasks and SFT data; math-verify does not
return the string it matched).
"""
from __future__ import annotations

import math
import re
from fractions import Fraction

from megarlhf.rewards.api import REWARDS, RewardInput, in_process, needs_ground_truth, preload

_HASHES = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS = re.compile(r"(?:the\s+)?(?:final\s+)?answer\s+is\s*:?\s*([^\n]+)", re.IGNORECASE)
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)(/\d+)?$")


def _boxed_spans(text: str) -> list[tuple[int, str]]:
    """(start, content) of every ``\\boxed{...}`` with balanced braces."""
    spans = []
    for match in re.finditer(r"\\boxed\s*\{", text):
        depth, i = 1, match.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            spans.append((match.start(), text[match.end():i - 1]))
    return spans


def _clean(answer: str) -> str:
    answer = answer.strip()
    answer = re.sub(r"[.\s]+$", "", answer)  # "19." at the end of a sentence
    return answer.strip().strip("$").strip()


def extract_final_answer(text: str) -> str | None:
    """The last ``\\boxed{X}`` / ``#### X`` / ``The answer is X`` in ``text`` (X cleaned), or None."""
    candidates = _boxed_spans(text)
    candidates += [(m.start(), m.group(1)) for m in _HASHES.finditer(text)]
    candidates += [(m.start(), m.group(1)) for m in _ANSWER_IS.finditer(text)]
    if not candidates:
        return None
    _, answer = max(candidates, key=lambda c: c[0])
    answer = _clean(answer)
    return answer or None


def _normalise(answer: str) -> str:
    answer = _clean(answer)
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", answer):
        answer = answer.replace(",", "")
    return re.sub(r"\s+", " ", answer)


def parse_number(text: str) -> Fraction | float | None:
    """A number from an answer string (``"1,234"``, ``"$5"``, ``"50%"`` -> 50, ``"3/4"``), else None."""
    text = _clean(text).replace(",", "").rstrip("%").lstrip("$").strip()
    if not _NUMBER.match(text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


@REWARDS.register("exact_match")
@needs_ground_truth
@in_process
def exact_match(sample: RewardInput) -> float:
    answer = extract_final_answer(sample.response)
    if answer is None or sample.ground_truth is None:
        return 0.0
    return float(_normalise(answer) == _normalise(str(sample.ground_truth)))


@REWARDS.register("numeric")
@needs_ground_truth
@in_process
def numeric(sample: RewardInput, rel_tol: float = 1e-9, abs_tol: float = 1e-9) -> float:
    answer = extract_final_answer(sample.response)
    if answer is None or sample.ground_truth is None:
        return 0.0
    got, want = parse_number(answer), parse_number(str(sample.ground_truth))
    if got is None or want is None:
        return 0.0
    return float(math.isclose(float(got), float(want), rel_tol=rel_tol, abs_tol=abs_tol))


def _is_number_literal(parsed: list) -> bool:
    """Whether math-verify's parse (``[sympy expression, matched string]``) is a number as written:
    ``168``, ``-3/4``, ``\\frac{1}{2}``, ``0.5``, ``1,234`` -- not an expression such as ``97 + 71``."""
    expression, matched = parsed[0], str(parsed[-1])
    return bool(getattr(expression, "is_Number", False)) or parse_number(matched) is not None


@REWARDS.register("math_verify")
@needs_ground_truth
@preload("math_verify")
def math_verify(sample: RewardInput, require_number: bool = True) -> float:
    from math_verify import parse, verify

    if sample.ground_truth is None:
        return 0.0
    gold = parse(str(sample.ground_truth), parsing_timeout=None)
    if not gold:
        # a bare ground truth like "19" or "1/2" parses as LaTeX when wrapped; math-verify needs a
        # recognisable form for anything that is not a plain number
        gold = parse(f"${sample.ground_truth}$", parsing_timeout=None)
    answer = parse(sample.response, parsing_timeout=None)
    if not gold or not answer:
        return 0.0
    if require_number and _is_number_literal(gold) and not _is_number_literal(answer):
        return 0.0
    return float(verify(gold, answer, timeout_seconds=None))
