"""Benchmark: what one sandboxed ``code_tests`` call costs, side by side in one process.

Three ways to run the same small program and its 3 tests, ``--runs`` times each (median per call):

* in-process ``exec`` (no isolation at all: the floor any per-call isolation is compared with);
* the sandbox's child process without namespaces (``isolation: none``: a fresh interpreter, rlimits);
* the sandbox as it runs here (``megarlhf.isolation.sandbox.isolation()``: with namespaces where allowed).

Also the throughput of ``--batch`` calls through the reward runner (``code_tests`` with its default 4
worker threads), as a GRPO step would score a batch. Prints seconds and ratios.
Usage:  .venv/bin/python bench/bench_sandbox.py [--runs 20] [--batch 32]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROGRAM = "def square(x):\n    return x * x\n"
TESTS = [{"call": "square(2)", "expected": 4}, {"call": "square(-3)", "expected": 9},
         {"call": "square(0)", "expected": 0}]


def _median(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _in_process() -> None:
    namespace: dict = {}
    exec(compile(PROGRAM, "solution.py", "exec"), namespace)
    for test in TESTS:
        assert eval(compile(test["call"], "test", "eval"), namespace) == test["expected"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    from megarlhf.isolation import sandbox
    from megarlhf.rewards import CombinedReward, RewardInput
    from megarlhf.config.reward import RewardConfig, RewardSpec

    here = sandbox.isolation()
    interpreter = sandbox._sandbox()[1]
    rows = {"in-process exec": _median(_in_process, args.runs)}
    original = sandbox._sandbox
    sandbox._sandbox = lambda: ("none", interpreter)  # the same child process, without namespaces
    try:
        unisolated = sandbox.SandboxLimits(allow_unisolated=True)
        rows["child process, no namespaces"] = _median(lambda: sandbox.run_tests(PROGRAM, TESTS, unisolated),
                                                       args.runs)
    finally:
        sandbox._sandbox = original
    rows[f"sandbox here ({here})"] = _median(lambda: sandbox.run_tests(PROGRAM, TESTS), args.runs)
    reward = CombinedReward(RewardConfig(functions=[RewardSpec("code_tests")]))
    samples = [RewardInput(prompt="", response=PROGRAM, metadata={"tests": TESTS}) for _ in range(args.batch)]
    start = time.perf_counter()
    result = reward(samples)
    batch_s = time.perf_counter() - start
    assert result.rewards == [1.0] * args.batch, result.failures
    print(f"one call, median of {args.runs} (interpreter {interpreter}):")
    base = rows["child process, no namespaces"]
    for name, seconds in rows.items():
        print(f"  {name:34s} {seconds * 1e3:8.1f} ms   {seconds / base:6.2f}x the child process")
    print(f"reward runner, {args.batch} calls on 4 threads: {batch_s:.2f} s "
          f"({batch_s / args.batch * 1e3:.1f} ms per sample)")


if __name__ == "__main__":
    main()
