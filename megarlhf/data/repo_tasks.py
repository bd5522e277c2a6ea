"""A synthetic repository-editing task for the ``repo`` environment: small generated Python packages, each
with one planted bug, visible tests to run and hidden tests that score the fix.

Every task is one of :data:`TEMPLATES`: a function with its docstring, its correct body and a buggy body
that differs by one small edit (an off-by-one range, a wrong comparison or operator, a wrong start value),
placed in ``<package>/core.py`` beside a correct helper; the package name and the test inputs are drawn at
random. Expected values come from running the correct body here (trusted code of this module), and a task
is kept only if the buggy body fails at least one visible and one hidden test. Rows (JSONL)::

    {"prompt": "...", "answer": "", "files": {path: text}, "program": "from pkg.core import *",
     "visible_tests": [{"call": ..., "expected": ...}], "hidden_tests": [...], "template": name}

The visible tests are also written into the repository as ``test_core.py`` (assert statements for the
model to read; the environment runs the call tests). Train and held-out rows are disjoint by content.
Usage: ``python -m megarlhf.data.repo_tasks OUT_DIR [--n-train 200] [--n-heldout 50] [--seed 0]``.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

PACKAGES = ("shapes", "ledger", "inventory", "grades", "weather", "orders", "scores", "library", "garden",
            "transit")


@dataclass(frozen=True)
class Template:
    name: str
    signature: str  # def line
    doc: str
    correct: str  # body, indented 4
    buggy: str
    inputs: Callable[[random.Random], tuple]  # the arguments of one test call


def _ints(rng: random.Random, low: int = -20, high: int = 20, size: tuple[int, int] = (0, 8)) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(*size))]


TEMPLATES = (
    Template("clamp", "def clamp(x, low, high):", "Returns x limited to the range [low, high].",
             "    return max(low, min(x, high))", "    return min(low, max(x, high))",
             lambda rng: (rng.randint(-30, 30), rng.randint(-10, 0), rng.randint(1, 10))),
    Template("count_between", "def count_between(values, low, high):",
             "Counts the values v with low <= v <= high.",
             "    return sum(1 for v in values if low <= v <= high)",
             "    return sum(1 for v in values if low < v <= high)",
             lambda rng: (_ints(rng, -5, 5, (3, 9)), rng.randint(-3, 0), rng.randint(0, 3))),
    Template("last_index", "def last_index(values, target):",
             "Returns the index of the last value equal to target, or -1 if there is none.",
             "    for i in range(len(values) - 1, -1, -1):\n        if values[i] == target:\n            return i\n"
             "    return -1",
             "    for i in range(len(values) - 1, 0, -1):\n        if values[i] == target:\n            return i\n"
             "    return -1",
             lambda rng: (_ints(rng, 0, 3, (1, 6)), rng.randint(0, 3))),
    Template("running_max", "def running_max(values):",
             "Returns the list of the largest value seen so far at each position.",
             "    out = []\n    for v in values:\n        out.append(v if not out else max(out[-1], v))\n    return out",
             "    out = []\n    best = 0\n    for v in values:\n        best = max(best, v)\n        out.append(best)\n"
             "    return out",
             lambda rng: (_ints(rng, -9, 9, (1, 7)),)),
    Template("factorial", "def factorial(n):", "Returns n! for n >= 0.",
             "    result = 1\n    for k in range(2, n + 1):\n        result *= k\n    return result",
             "    result = 1\n    for k in range(2, n):\n        result *= k\n    return result",
             lambda rng: (rng.randint(0, 12),)),
    Template("word_count", "def word_count(text):", "Counts the words of text (separated by any whitespace).",
             "    return len(text.split())", "    return len(text.split(' '))",
             lambda rng: (rng.choice(["", " "]).join(rng.choice(["a", "bc", "  ", "def", " x"]) for _ in
                                                         range(rng.randint(0, 6))),)),
    Template("total_after_discount", "def total_after_discount(prices, discount):",
             "Returns the sum of prices after taking off the share discount (0.25 takes off a quarter).",
             "    return sum(prices) * (1 - discount)", "    return sum(prices) * (1 + discount)",
             lambda rng: ([rng.randint(1, 50) for _ in range(rng.randint(1, 5))], rng.choice([0.0, 0.25, 0.5]))),
)

HELPER = '''

def describe(values):
    """A short description of a list, for messages."""
    return f"{len(values)} values"
'''


def _call_text(name: str, args: tuple) -> str:
    return f"{name}({', '.join(repr(a) for a in args)})"


def _function(template: Template, body: str) -> Callable:
    namespace: dict[str, Any] = {}
    exec(f"{template.signature}\n{body}\n", namespace)  # noqa: S102 - this module's own templates
    return namespace[template.name]


def _tests(template: Template, rng: random.Random, count: int, seen: set[str]) -> tuple[list[dict], int]:
    """``count`` call tests of inputs not in ``seen`` (which gains them), and how many the buggy body fails."""
    correct, buggy = _function(template, template.correct), _function(template, template.buggy)
    tests, failing = [], 0
    for _ in range(count * 20):
        args = template.inputs(rng)
        call = _call_text(template.name, args)
        if call in seen:
            continue
        seen.add(call)
        expected = correct(*args)
        failing += _safe(buggy, args) != expected
        tests.append({"call": call, "expected": expected})
        if len(tests) == count:
            break
    return tests, failing


def _safe(function: Callable, args: tuple) -> Any:
    try:
        return function(*args)
    except Exception:  # noqa: BLE001 - a buggy body may raise: that test fails
        return None


def make_task(rng: random.Random) -> dict[str, Any] | None:
    """One row (module docstring), or None when the drawn tests do not expose the bug."""
    template = rng.choice(TEMPLATES)
    package = rng.choice(PACKAGES)
    calls: set[str] = set()
    visible, visible_failing = _tests(template, rng, 3, calls)
    hidden, hidden_failing = _tests(template, rng, 6, calls)
    if not (visible_failing and hidden_failing and len(visible) == 3 and len(hidden) == 6):
        return None
    core = f'{template.signature}\n    """{template.doc}"""\n{template.buggy}\n' + HELPER
    test_file = f"from {package}.core import *\n\n\n" + "".join(
        f"def test_{i}():\n    assert {t['call']} == {t['expected']!r}\n\n\n" for i, t in enumerate(visible))
    files = {f"{package}/__init__.py": "", f"{package}/core.py": core, "test_core.py": test_file.rstrip() + "\n"}
    prompt = (f"The Python package `{package}` has a bug in `{template.name}` ({template.doc}) that makes some "
              f"of its tests fail. Find and fix it with the tools: view files, edit them, and run the visible "
              f"tests (test_core.py). When the tests pass, say that you are done.")
    return {"prompt": prompt, "answer": "", "files": files, "program": f"from {package}.core import *",
            "visible_tests": visible, "hidden_tests": hidden, "template": template.name}


def write_tasks(out_dir: str | Path, n_train: int, n_heldout: int, seed: int = 0) -> dict[str, int]:
    """Writes ``train.jsonl`` and ``heldout.jsonl`` (disjoint by content); returns the row counts."""
    rng, seen = random.Random(seed), set()
    splits: dict[str, list[dict]] = {"train": [], "heldout": []}
    for split, count in (("train", n_train), ("heldout", n_heldout)):
        attempts = 0
        while len(splits[split]) < count:
            attempts += 1
            if attempts > 100 * count:
                raise RuntimeError(f"repo_tasks: could not draw {count} distinct {split} tasks")
            row = make_task(rng)
            key = None if row is None else json.dumps([row["files"], row["hidden_tests"]], sort_keys=True)
            if row is not None and key not in seen:
                seen.add(key)
                splits[split].append(row)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {split: len(rows) for split, rows in splits.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the synthetic repository-editing task as JSONL.")
    parser.add_argument("out_dir")
    parser.add_argument("--n-train", type=int, default=200)
    parser.add_argument("--n-heldout", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    counts = write_tasks(args.out_dir, args.n_train, args.n_heldout, args.seed)
    print(f"wrote {counts['train']} train and {counts['heldout']} held-out tasks to {args.out_dir}")


if __name__ == "__main__":
    main()
