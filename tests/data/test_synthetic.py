"""Synthetic arithmetic task: answers checked by evaluating each row's expression independently,
the prompt states exactly the expression's numbers, splits are disjoint, output is seeded."""
from __future__ import annotations

import ast
import json
import operator
import re
from fractions import Fraction

import pytest

from megarlhf.data.synthetic import generate_split, write_arithmetic_task
from megarlhf.data.synthetic import TaskSettings, mix_response_styles
from megarlhf.rewards import REWARDS, RewardInput
from megarlhf.rewards.answers import extract_final_answer

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
    rows = generate_split(30, False, seed=0, task=TaskSettings(max_steps=1, ops=("add",), answer_format="hashes"))
    for row in rows:
        assert " + " in row["expression"] and row["expression"].count("+") == 1
        assert row["response"].endswith(f"\n#### {row['answer']}")
    with pytest.raises(ValueError, match="could only make"):
        generate_split(500, False, seed=0, task=TaskSettings(max_steps=1, max_value=3, ops=("add",)))
    with pytest.raises(ValueError, match="bad difficulty settings"):
        generate_split(5, False, seed=0, task=TaskSettings(ops=("pow",)))


def test_sft_response_styles(tmp_path):
    paths = write_arithmetic_task(tmp_path, n_train=600, n_heldout=10, seed=3, sft_direct_fraction=0.3,
                                  sft_answer_first_fraction=0.4)
    train, sft = _read(paths["train"]), _read(paths["sft_train"])
    styles = {"direct": 0, "answer_first": 0, "worked": 0}
    for s, t in zip(sft, train):
        final = f"The answer is {t['answer']}."
        if s["response"] == final:
            styles["direct"] += 1
        elif s["response"].startswith(final + "\nStart with "):
            styles["answer_first"] += 1
            work = s["response"].split("\n", 1)[1]
            assert extract_final_answer(s["response"]) == t["answer"]
            assert work.endswith(f"= {t['answer']}.") and "answer" not in work
        else:
            assert s["response"].startswith("Start with ") and s["response"].endswith(final)
            styles["worked"] += 1
    assert 0.22 < styles["direct"] / 600 < 0.38 and 0.32 < styles["answer_first"] / 600 < 0.48, styles
    hashes = mix_response_styles(generate_split(50, False, seed=0, task=TaskSettings(answer_format="hashes")), seed=0,
                                 answer_first=1.0,
                                 answer_format="hashes")
    assert all(r["response"].startswith(f"#### {r['answer']}\nStart with ") for r in hashes)
    again = write_arithmetic_task(tmp_path / "b", 600, 10, seed=3, sft_direct_fraction=0.3,
                                  sft_answer_first_fraction=0.4)
    assert _read(again["sft_train"]) == sft
    with pytest.raises(ValueError, match="sft_direct_fraction"):
        mix_response_styles(sft, seed=0, direct=0.7, answer_first=0.4)


def test_step_range():
    rows = generate_split(300, False, seed=0, task=TaskSettings(min_steps=2, max_steps=3, ops=("add", "sub")))
    counts = {row["expression"].count(" + ") + row["expression"].count(" - ") for row in rows}
    assert counts == {2, 3}
    with pytest.raises(ValueError, match="min_steps=3 and max_steps=2"):
        generate_split(5, False, seed=0, task=TaskSettings(min_steps=3, max_steps=2))


def test_preference_pairs_prefer_the_right_answer_in_every_rejected_kind(tmp_path):
    from megarlhf.data.synthetic import REJECTED_KINDS, write_preference_task

    paths = write_preference_task(tmp_path, n_train=300, n_heldout=50, seed=3, max_steps=3, max_value=15,
                                  ops=("add", "sub"), instruction=None)
    rows = [json.loads(line) for line in paths["pairs_train"].read_text().splitlines()]
    step = re.compile(r"(-?\d+) ([-+]) (\d+) = (-?\d+)\.")
    exact = REWARDS.get("exact_match")
    assert {r["rejected_kind"] for r in rows} == set(REJECTED_KINDS)
    for row in rows:
        assert exact(RewardInput(row["prompt"], row["chosen"], row["answer"])) == 1.0
        assert exact(RewardInput(row["prompt"], row["rejected"], row["answer"])) == 0.0, row
        if row["rejected_kind"] == "misread":  # right arithmetic on one changed operand
            chosen, rejected = step.findall(row["chosen"]), step.findall(row["rejected"])
            assert len(chosen) == len(rejected)
            for a, op, n, v in rejected:
                assert int(v) == (int(a) + int(n) if op == "+" else int(a) - int(n))
            assert sum(c[2] != r[2] for c, r in zip(chosen, rejected)) == 1


def test_bare_style_asks_the_expression(tmp_path):
    rows = generate_split(50, heldout=False, seed=1, task=TaskSettings(max_steps=1, max_value=99, ops=("add",),
                                                                       style="bare", instruction="Think."))
    for row in rows:
        a, b = re.fullmatch(r"What is (\d+) \+ (\d+)\? Think\.", row["prompt"]).groups()
        assert int(row["answer"]) == int(a) + int(b)
        assert row["response"] == f"{a} + {b} = {row['answer']}. The answer is {row['answer']}."
    with pytest.raises(ValueError, match="style must be 'word' or 'bare'"):
        generate_split(5, heldout=False, seed=1, task=TaskSettings(style="table"))


def test_tool_call_transcripts_are_what_a_plain_rollout_writes():
    from megarlhf.envs.calculator import calculate
    from megarlhf.envs.parsers import PARSERS
    from megarlhf.envs.calculator import CALCULATOR_TOOL

    rows = generate_split(40, heldout=False, seed=2, task=TaskSettings(max_steps=1, max_value=999, ops=("add",),
                                                                       style="bare", instruction=None))
    mixed = mix_response_styles(rows, seed=2, tool_call=0.5)
    transcripts = [r for r in mixed if r["response"].startswith("<tool_call>")]
    assert 10 < len(transcripts) < 30
    parse = PARSERS.get("hermes")([CALCULATOR_TOOL])
    for row in transcripts:
        call, _, rest = row["response"].partition("</tool_call>")
        parsed = parse(call + "</tool_call>")
        observation = calculate(parsed.arguments["expression"])
        # the multi-turn loop's plain-text observation, then the answer turn
        assert rest == f"\n<tool_response>\n{observation}\n</tool_response>\nThe answer is {row['answer']}."
    with pytest.raises(ValueError, match="sum to at most 1"):
        mix_response_styles(rows, seed=2, direct=0.6, tool_call=0.6)
