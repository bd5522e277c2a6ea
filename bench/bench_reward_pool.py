"""Benchmark: reward calls and tool calls on threads (in-process) vs in killable worker processes.

Rewards: the same batch (``--batch`` GSM8K-style responses) is scored by ``math_verify`` and by
``numeric`` on the thread pool (what a function declared ``in_process`` uses) and on the worker-process
pool (every other function). Tools: one turn of ``--batch`` calculator calls (``ToolRunner.step``,
parsing included) with the ``calculator`` environment as shipped (stateless: worker processes, each call
on an episode made afresh) and with the runner told to keep the episodes in-process (threads, as a
stateful environment runs). Each ``--repeats`` times after a warm-up (worker start-up excluded; printed
once). Prints the median milliseconds per batch and the ratio process / thread.
Usage:  .venv/bin/python bench/bench_reward_pool.py [--batch 64] [--workers 4] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from megarlhf.isolation.process_pool import TimedProcessPool
    from megarlhf.rewards import RewardInput, resolve_reward
    from megarlhf.isolation.timed_calls import TimedCall, TimedThreadPool

    samples = [RewardInput(prompt="q", response=f"Step 1: 12 * {i} = {12 * i}. #### {12 * i + i % 3}",
                           ground_truth=str(12 * i)) for i in range(args.batch)]
    threads = TimedThreadPool(args.workers)
    print(f"{args.batch} samples per batch, {args.workers} workers, median of {args.repeats} batches")
    for name in ("numeric", "math_verify"):
        fn = resolve_reward(name)
        processes = TimedProcessPool(args.workers, "megarlhf.rewards.api:resolve_reward", [name])
        start = time.perf_counter()
        processes.run([TimedCall(name, s, {}) for s in samples[:args.workers]], 60.0)
        startup = time.perf_counter() - start
        threads.run([TimedCall(fn, s, {}) for s in samples], 60.0)  # warm-up: imports on first use
        times = {"thread": [], "process": []}
        for _ in range(args.repeats):
            for kind in times:
                calls = [TimedCall(fn if kind == "thread" else name, s, {}) for s in samples]
                start = time.perf_counter()
                (threads if kind == "thread" else processes).run(calls, 60.0)
                times[kind].append(time.perf_counter() - start)
                assert all(c.error is None for c in calls), [c.error for c in calls if c.error][:1]
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"  {name:12s} thread {med['thread'] * 1e3:8.1f} ms   process {med['process'] * 1e3:8.1f} ms   "
              f"process / thread {med['process'] / med['thread']:5.2f}x   (worker start-up {startup:.2f} s)")
        processes.close()
    threads.close()
    bench_tools(args)


def bench_tools(args) -> None:
    import json

    from megarlhf.config.rollout import EnvConfig
    from megarlhf.envs import ToolRunner

    config = EnvConfig("calculator", parser="hermes", num_workers=args.workers)
    conversations = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "<tool_call>" + json.dumps(
        {"name": "calculator", "arguments": {"expression": f"({i} * 37 + 12) // 5 - sqrt({i})"}}) + "</tool_call>"}]
        for i in range(args.batch)]
    times, startup = {}, 0.0
    for kind in ("thread", "process"):
        runner = ToolRunner(config)
        runner.stateless = kind == "process"
        start = time.perf_counter()
        runner.step(runner.start([{}] * args.batch), conversations)  # warm-up
        startup = time.perf_counter() - start if kind == "process" else startup
        times[kind] = []
        for _ in range(args.repeats):
            handles = runner.start([{}] * args.batch)
            start = time.perf_counter()
            batch = runner.step(handles, conversations)
            times[kind].append(time.perf_counter() - start)
            assert not batch.failures and all(o.observation for o in batch.outcomes), batch.failures[:1]
        runner.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"  {'calculator':12s} thread {med['thread'] * 1e3:8.1f} ms   process {med['process'] * 1e3:8.1f} ms   "
          f"process / thread {med['process'] / med['thread']:5.2f}x   (one turn of {args.batch} tool calls; "
          f"first turn with worker start-up {startup:.2f} s)")


if __name__ == "__main__":
    main()
