"""A synthetic verifiable task for demos and tests: multi-step arithmetic word problems.

A problem starts with a count (``Tom has 12 apples.``) and applies ``min_steps``..``max_steps`` operations, each
told by one of several sentence templates: add (``He buys 7 more.``), subtract, multiply (``... grows to 3
times its size``) and exact division (``... into 4 equal bags and keeps one bag``). Names, objects,
openings, operation sentences and questions are drawn at random, so the surface form varies while the
arithmetic stays checkable. Every number in a prompt is written in digits, in the order the expression
uses them, and each row also stores that expression (``((12 + 7) - 3) * 2``).

Train and held-out splits are disjoint by arithmetic content, not only by wording: a problem's split is
fixed by a hash of its start value and operation sequence, so a held-out problem never appears in train
under another name. Rows are written as JSONL in the format users bring (``prompt``, ``answer``), plus
SFT rows (``prompt``, ``response``) with a worked solution ending in ``The answer is N.`` or ``#### N``.
SFT data can mix in two other response styles found in real instruction data: a bare answer, and the
answer stated first with the working after it (a model that imitates either must guess before computing).

Preference pairs (:func:`write_preference_task`) have a known ground truth: the chosen response is the
worked solution with the right answer; the rejected one is the same problem answered wrongly, in one of
five ways: a slip in the last step carried into the answer, correct working with a wrong final answer,
the working without any final-answer line, a wrong answer guessed first with the working after it (the
answer-first style's typical failure), or one of the problem's numbers misread and the rest computed
correctly from it (right arithmetic on the wrong problem).

Difficulty knobs: ``min_steps``/``max_steps`` (operations per problem), ``max_value`` (operand range), ``ops``;
``style="bare"`` asks the expression itself ("What is 59 + 63?") instead of a word problem.
No offline package ships such data (GSM8K and MATH need the hub; docs/PLATFORM.md).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from megarlhf.core.errors import DataError

NAMES = ("Tom", "Mia", "Ravi", "Lena", "Omar", "Sofia", "Jack", "Aiko", "Noah", "Zara", "Ivan", "Emma",
         "Kofi", "Lucia", "Ben", "Nadia")
ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "stamps", "shells",
         "cards", "balloons", "carrots", "buttons", "candles", "rocks", "ribbons")
OPENINGS = ("{name} has {n} {item}.", "{name} starts with {n} {item}.", "There are {n} {item} in {name}'s bag.",
            "{name} owns {n} {item}.", "At first, {name} has {n} {item}.")
SENTENCES = {
    "add": ("{name} buys {n} more {item}.", "A friend gives {name} {n} {item}.",
            "Then {name} finds {n} more {item}.", "{name} collects another {n} {item}.",
            "Later, {name} wins {n} {item}."),
    "sub": ("{name} gives {n} {item} to a friend.", "{name} loses {n} {item}.", "Then {name} sells {n} of the {item}.",
            "{name} uses up {n} {item}.", "Later, {n} of the {item} are given away."),
    "mul": ("The number of {item} {name} has grows to {n} times as many.",
            "{name} ends up with {n} times as many {item}.", "Then the pile of {item} becomes {n} times as large."),
    "div": ("{name} splits the {item} into {n} equal bags and keeps one bag.",
            "{name} shares the {item} equally among {n} children, keeping one share.",
            "Then only one of {n} equal parts of the {item} is left."),
}
QUESTIONS = ("How many {item} does {name} have now?", "How many {item} are there at the end?",
             "How many {item} does {name} end up with?", "What is the final number of {item}?")
SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
DEFAULT_INSTRUCTION = "Solve the problem and end with 'The answer is' followed by the number."


@dataclass(frozen=True)
class Problem:
    start: int
    steps: tuple[tuple[str, int], ...]  # (op, operand)
    answer: int

    @property
    def key(self) -> str:
        return f"{self.start}|" + "|".join(f"{op}{n}" for op, n in self.steps)

    @property
    def expression(self) -> str:
        expr = str(self.start)
        for i, (op, n) in enumerate(self.steps):
            expr = f"{expr} {SYMBOLS[op]} {n}" if i == 0 else f"({expr}) {SYMBOLS[op]} {n}"
        return expr


def _next_step(rng: random.Random, value: int, ops: tuple[str, ...], max_value: int) -> tuple[str, int, int]:
    """(op, operand, new value) of one operation that keeps the count a positive integer."""
    choices = [op for op in ops
               if op == "add" or (op == "sub" and value >= 2) or (op == "mul" and value * 2 <= max_value * 4)
               or (op == "div" and any(value % k == 0 for k in range(2, 10)))]
    op = rng.choice(choices)
    if op == "add":
        n = rng.randint(1, max_value)
        return op, n, value + n
    if op == "sub":
        n = rng.randint(1, value - 1)
        return op, n, value - n
    if op == "mul":
        n = rng.randint(2, max(2, min(5, (max_value * 4) // value)))
        return op, n, value * n
    n = rng.choice([k for k in range(2, 10) if value % k == 0])
    return op, n, value // n


def random_problem(rng: random.Random, max_steps: int, max_value: int, ops: tuple[str, ...],
                   min_steps: int = 1) -> Problem:
    value = start = rng.randint(2, max_value)
    steps = []
    for _ in range(rng.randint(min_steps, max_steps)):
        op, n, value = _next_step(rng, value, ops, max_value)
        steps.append((op, n))
    return Problem(start, tuple(steps), value)


def in_heldout(problem: Problem, heldout_fraction: float) -> bool:
    """The problem's split, from a hash of its arithmetic (stable across runs and machines)."""
    digest = int(hashlib.sha256(problem.key.encode()).hexdigest()[:8], 16)
    return digest < heldout_fraction * 0x100000000


def render(problem: Problem, rng: random.Random, instruction: str | None, style: str = "word") -> tuple[str, str]:
    """(prompt, worked solution without the final-answer line): a word problem in randomly chosen words
    (``style="word"``) or the bare expression, "What is 59 + 63?" (``style="bare"``)."""
    if style == "bare":
        work, value = [], problem.start
        for op, n in problem.steps:
            new = {"add": value + n, "sub": value - n, "mul": value * n, "div": value // n}[op]
            work.append(f"{value} {SYMBOLS[op]} {n} = {new}.")
            value = new
        return f"What is {problem.expression}?" + (f" {instruction}" if instruction else ""), " ".join(work)
    words = {"name": rng.choice(NAMES), "item": rng.choice(ITEMS)}
    sentences = [rng.choice(OPENINGS).format(n=problem.start, **words)]
    work, value = [], problem.start
    for op, n in problem.steps:
        sentences.append(rng.choice(SENTENCES[op]).format(n=n, **words))
        new = {"add": value + n, "sub": value - n, "mul": value * n, "div": value // n}[op]
        work.append(f"{value} {SYMBOLS[op]} {n} = {new}.")
        value = new
    sentences.append(rng.choice(QUESTIONS).format(**words))
    prompt = " ".join(sentences) + (f"\n{instruction}" if instruction else "")
    solution = f"Start with {problem.start} {words['item']}. " + " ".join(work)
    return prompt, solution


def final_answer(answer: str, answer_format: str) -> str:
    """The line a response ends with: ``The answer is N.`` or ``#### N``."""
    return f"The answer is {answer}." if answer_format == "answer_is" else f"#### {answer}"


@dataclass(frozen=True)
class TaskSettings:
    """The synthetic task's difficulty and format: steps per problem, the largest operand, the operations,
    the share of problems held out, the instruction, how the answer line reads and the prompt ``style``
    (:func:`render`)."""

    max_steps: int = 3
    max_value: int = 20
    ops: tuple[str, ...] = ("add", "sub", "mul", "div")
    heldout_fraction: float = 0.2
    instruction: str | None = DEFAULT_INSTRUCTION
    answer_format: str = "answer_is"
    min_steps: int = 1
    style: str = "word"

    def __post_init__(self):
        if self.style not in ("word", "bare"):
            raise DataError(f"style must be 'word' or 'bare', got {self.style!r}")
        if self.answer_format not in ("answer_is", "hashes"):
            raise DataError(f"answer_format must be 'answer_is' or 'hashes', got {self.answer_format!r}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise DataError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        unknown = set(self.ops) - set(SYMBOLS)
        if unknown or not self.ops or not 1 <= self.min_steps <= self.max_steps or self.max_value < 2:
            raise DataError(f"bad difficulty settings: ops={self.ops} (known {sorted(SYMBOLS)}), min_steps="
                            f"{self.min_steps} and max_steps={self.max_steps} (1 <= min_steps <= max_steps), "
                            f"max_value={self.max_value} (>= 2)")


def generate_split(n: int, heldout: bool, seed: int, task: TaskSettings = TaskSettings()) -> list[dict]:
    """``n`` distinct problems of one split as rows: prompt, answer, expression, response (worked) and
    work (the worked solution without its final-answer line)."""
    rng = random.Random(f"{seed}-{'heldout' if heldout else 'train'}")
    rows, seen = [], set()
    for _ in range(200 * n + 1000):
        if len(rows) == n:
            break
        problem = random_problem(rng, task.max_steps, task.max_value, task.ops, task.min_steps)
        if problem.key in seen or in_heldout(problem, task.heldout_fraction) != heldout:
            continue
        seen.add(problem.key)
        prompt, work = render(problem, rng, task.instruction, task.style)
        final = final_answer(str(problem.answer), task.answer_format)
        rows.append({"prompt": prompt, "answer": str(problem.answer), "expression": problem.expression,
                     "response": f"{work} {final}" if task.answer_format == "answer_is" else f"{work}\n{final}",
                     "work": work})
    if len(rows) < n:
        raise DataError(f"could only make {len(rows)} distinct {'held-out' if heldout else 'train'} problems "
                        f"of {n} asked; raise max_value or max_steps")
    return rows


def write_jsonl(rows: list[dict], path: Path, keys: tuple[str, ...]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({k: row[k] for k in keys}) + "\n")
    return path


def tool_call_response(row: dict, answer_format: str = "answer_is") -> str:
    """A calculator transcript in plain text: the hermes-format call of the ``calculator`` tool on the
    problem's expression, the observation exactly as a plain-text multi-turn rollout appends it
    (:mod:`megarlhf.rollout.multi_turn`), then the final answer."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": row["expression"]}})
    return (f"<tool_call>{call}</tool_call>\n<tool_response>\n{row['answer']}\n</tool_response>\n"
            f"{final_answer(row['answer'], answer_format)}")


def mix_response_styles(rows: list[dict], seed: int, direct: float = 0.0, answer_first: float = 0.0,
                        answer_format: str = "answer_is", tool_call: float = 0.0) -> list[dict]:
    """SFT rows where a seeded share ``direct`` of responses is only the final-answer line, a share
    ``answer_first`` states the final answer on its first line and the working after it, and a share
    ``tool_call`` asks the calculator (:func:`tool_call_response`); the rest keep the worked solution
    followed by the answer."""
    shares = {"sft_direct_fraction": direct, "sft_answer_first_fraction": answer_first,
              "sft_tool_call_fraction": tool_call}
    if not (all(0.0 <= v <= 1.0 for v in shares.values()) and sum(shares.values()) <= 1.0):
        raise DataError(f"{shares} must each be in [0, 1] and sum to at most 1")
    rng = random.Random(f"{seed}-direct")
    mixed = []
    for row in rows:
        draw, final = rng.random(), final_answer(row["answer"], answer_format)
        if draw < direct:
            row = {**row, "response": final}
        elif draw < direct + answer_first:
            row = {**row, "response": f"{final}\n{row['work']}"}
        elif draw < direct + answer_first + tool_call:
            row = {**row, "response": tool_call_response(row, answer_format)}
        mixed.append(row)
    return mixed


def write_arithmetic_task(out_dir: str | Path, n_train: int, n_heldout: int, seed: int = 0,
                          sft_direct_fraction: float = 0.0, sft_answer_first_fraction: float = 0.0,
                          sft_tool_call_fraction: float = 0.0, **knobs) -> dict[str, Path]:
    """Writes ``train.jsonl`` and ``heldout.jsonl`` (prompt, answer, expression) and ``sft_train.jsonl``
    (prompt, response) under ``out_dir``; ``knobs`` are :class:`TaskSettings`' fields and the
    fractions the shares of SFT responses in the bare-answer and answer-first styles
    (:func:`mix_response_styles`)."""
    out, task = Path(out_dir), TaskSettings(**knobs)
    train = generate_split(n_train, heldout=False, seed=seed, task=task)
    heldout = generate_split(n_heldout, heldout=True, seed=seed, task=task)
    sft = mix_response_styles(train, seed, sft_direct_fraction, sft_answer_first_fraction, task.answer_format,
                              sft_tool_call_fraction)
    return {"train": write_jsonl(train, out / "train.jsonl", ("prompt", "answer", "expression")),
            "heldout": write_jsonl(heldout, out / "heldout.jsonl", ("prompt", "answer", "expression")),
            "sft_train": write_jsonl(sft, out / "sft_train.jsonl", ("prompt", "response"))}


REJECTED_KINDS = ("wrong_step", "wrong_answer", "no_answer_line", "answer_first", "misread")
_STEP = re.compile(r"(-?\d+) ([-+*/]) (\d+) = (-?\d+)\.")


def misread_work(work: str, rng: random.Random) -> tuple[str, int] | None:
    """(``work`` with one operand of the problem misread and every later value recomputed from it, its final
    value): correct arithmetic on the wrong problem; None when the working has no step."""
    steps = list(_STEP.finditer(work))
    if not steps:
        return None
    k, value = rng.randrange(len(steps)), int(steps[0].group(1))
    pieces, end = [], 0
    for i, step in enumerate(steps):
        op, n = step.group(2), int(step.group(3))
        if i == k:
            n += rng.choice([d for d in (-2, -1, 1, 2) if n + d > 0])
        new = {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
        pieces += [work[end:step.start()], f"{value} {op} {n} = {new}."]
        value, end = new, step.end()
    return "".join(pieces) + work[end:], value


def rejected_response(row: dict, rng: random.Random, answer_format: str = "answer_is") -> tuple[str, str]:
    """(kind, response): a wrong answer to ``row``'s problem (see the module docstring)."""
    answer = int(row["answer"])
    wrong = answer + rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if answer + d >= 0])
    kind = rng.choice(REJECTED_KINDS)
    work = row["work"]
    if kind == "wrong_step":  # the last "= X." of the working becomes the wrong value
        cut = work.rfind("= ")
        work = f"{work[:cut]}= {wrong}." if cut >= 0 else work
    if kind == "no_answer_line":
        return kind, work
    misread = misread_work(work, rng) if kind == "misread" else None
    if misread is not None and misread[1] != answer:
        work, wrong = misread
    final = final_answer(str(wrong), answer_format)
    if kind == "answer_first":
        return kind, f"{final}\n{work}"
    return kind, f"{work} {final}" if answer_format == "answer_is" else f"{work}\n{final}"


def preference_rows(rows: list[dict], seed: int, answer_format: str = "answer_is") -> list[dict]:
    """Rows of (prompt, chosen, rejected, answer, rejected_kind): the worked solution preferred over a wrong
    response to the same problem (:func:`rejected_response`)."""
    rng = random.Random(f"{seed}-preference")
    pairs = []
    for row in rows:
        kind, rejected = rejected_response(row, rng, answer_format)
        pairs.append({"prompt": row["prompt"], "chosen": row["response"], "rejected": rejected,
                      "answer": row["answer"], "rejected_kind": kind})
    return pairs


def write_preference_task(out_dir: str | Path, n_train: int, n_heldout: int, seed: int = 0,
                          **knobs) -> dict[str, Path]:
    """Writes ``pairs_train.jsonl`` and ``pairs_heldout.jsonl`` (prompt, chosen, rejected, answer,
    rejected_kind) under ``out_dir``, from the same disjoint splits as :func:`write_arithmetic_task`."""
    out, task = Path(out_dir), TaskSettings(**knobs)
    keys = ("prompt", "chosen", "rejected", "answer", "rejected_kind")
    train = preference_rows(generate_split(n_train, heldout=False, seed=seed, task=task), seed, task.answer_format)
    heldout = preference_rows(generate_split(n_heldout, heldout=True, seed=seed, task=task), seed + 1,
                              task.answer_format)
    return {"pairs_train": write_jsonl(train, out / "pairs_train.jsonl", keys),
            "pairs_heldout": write_jsonl(heldout, out / "pairs_heldout.jsonl", keys)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the synthetic arithmetic task as JSONL.")
    parser.add_argument("out_dir")
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-heldout", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-steps", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--max-value", type=int, default=20)
    parser.add_argument("--ops", default="add,sub,mul,div", help="comma-separated operations (add, sub, mul, div)")
    parser.add_argument("--answer-format", choices=("answer_is", "hashes"), default="answer_is")
    parser.add_argument("--style", choices=("word", "bare"), default="word",
                        help="word problems, or the bare expression ('What is 59 + 63?')")
    parser.add_argument("--instruction", default=DEFAULT_INSTRUCTION, help="appended to every prompt")
    parser.add_argument("--sft-direct-fraction", type=float, default=0.0)
    parser.add_argument("--sft-answer-first-fraction", type=float, default=0.0)
    parser.add_argument("--sft-tool-call-fraction", type=float, default=0.0)
    args = parser.parse_args(argv)
    paths = write_arithmetic_task(args.out_dir, args.n_train, args.n_heldout, args.seed,
                                  sft_direct_fraction=args.sft_direct_fraction,
                                  sft_answer_first_fraction=args.sft_answer_first_fraction,
                                  sft_tool_call_fraction=args.sft_tool_call_fraction, min_steps=args.min_steps,
                                  max_steps=args.max_steps, max_value=args.max_value, answer_format=args.answer_format,
                                  ops=tuple(args.ops.split(",")), style=args.style, instruction=args.instruction)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
