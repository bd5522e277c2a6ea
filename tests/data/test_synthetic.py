"""Synthetic arithmetic task: answers checked by evaluating each row's expression independently,
the prompt states exactly the expression's numbers, splits are disjoint, output is seeded."""
from __future__ import annotations

import ast
import json
import operator
import re
from fractions import Fraction

import pytest

from megarlhf.data import generate_split, write_arithmetic_task
from megarlhf.data.synthetic import mix_direct_answers
from megarlhf.rewards import REWARDS, RewardInput

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expression: str) -> Fraction:
    """An independent evaluator of + - * / over integers (exact, via Fractions)."""
    def walk(node):
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        raise ValueError(f"unexpected node {ast.dump(node)}")
    return walk(ast.parse(expression, mode="eval").body)


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_answers_prompts_and_splits(tmp_path):
    paths = write_arithmetic_task(tmp_path, n_train=300, n_heldout=60, seed=11)
    train, heldout, sft = _read(paths["train"]), _read(paths["heldout"]), _read(paths["sft_train"])
    assert len(train) == 300 and len(heldout) == 60 and len(sft) == 300
    for row in train + heldout:
        value = evaluate(row["expression"])
        assert value.denominator == 1 and value > 0 and row["answer"] == str(value.numerator)
        numbers = [int(n) for n in re.findall(r"\d+", row["prompt"])]
        assert numbers == [int(n) for n in re.findall(r"\d+", row["expression"])]
    # disjoint by arithmetic content (the expression), hence also by prompt
    assert not {r["expression"] for r in train} & {r["expression"] for r in heldout}
    assert len({r["expression"] for r in train}) == 300
    # SFT rows: same prompts, a worked solution whose final answer the rule checkers accept
    assert [r["prompt"] for r in sft] == [r["prompt"] for r in train]
    for s, t in zip(sft, train):
        sample = RewardInput(s["prompt"], s["response"], t["answer"])
        assert s["response"].endswith(f"The answer is {t['answer']}.")
        assert REWARDS.get("exact_match")(sample) == 1.0
    # varied wording and difficulty
    assert len({r["prompt"].split(".")[0].split()[-1] for r in train}) > 5
    assert {r["expression"].count(" ") // 2 for r in train} == {1, 2, 3}


def test_seeded_knobs_and_hash_format():
    assert generate_split(20, False, seed=1) == generate_split(20, False, seed=1)
    assert generate_split(20, False, seed=1) != generate_split(20, False, seed=2)
    rows = generate_split(30, False, seed=0, max_steps=1, ops=("add",), answer_format="hashes")
    for row in rows:
        assert " + " in row["expression"] and row["expression"].count("+") == 1
        assert row["response"].endswith(f"\n#### {row['answer']}")
    with pytest.raises(ValueError, match="could only make"):
        generate_split(500, False, seed=0, max_steps=1, max_value=3, ops=("add",))
    with pytest.raises(ValueError, match="bad difficulty settings"):
        generate_split(5, False, seed=0, ops=("pow",))


def test_sft_direct_answer_mix(tmp_path):
    paths = write_arithmetic_task(tmp_path, n_train=400, n_heldout=10, seed=3, sft_direct_fraction=0.6)
    train, sft = _read(paths["train"]), _read(paths["sft_train"])
    direct = [s for s in sft if not s["response"].startswith("Start with")]
    assert 0.5 < len(direct) / len(sft) < 0.7
    for s, t in zip(sft, train):
        assert s["response"].endswith(f"The answer is {t['answer']}.")
        if s in direct:
            assert s["response"] == f"The answer is {t['answer']}."
    hashes = mix_direct_answers(generate_split(50, False, seed=0, answer_format="hashes"), 1.0, seed=0,
                                answer_format="hashes")
    assert all(r["response"].startswith("#### ") for r in hashes)
    assert _read(write_arithmetic_task(tmp_path / "b", 400, 10, seed=3, sft_direct_fraction=0.6)["sft_train"]) == sft
    with pytest.raises(ValueError, match="sft_direct_fraction"):
        mix_direct_answers(sft, 1.5, seed=0)
