"""Benchmark: one turn's tool calls on threads (the trainer's process) vs in killable worker processes.

The same batch of ``--batch`` calculator calls (``ToolRunner.step`` on one model turn per episode, parsing
included) runs with the ``calculator`` environment as shipped (stateless: worker processes, each call on
an episode made afresh) and with the runner told to keep the episodes in-process (threads, as a stateful
environment runs), ``--repeats`` times each after a warm-up turn (worker start-up excluded; printed
once). Prints the median milliseconds per turn and the ratio process / thread.
Usage:  .venv/bin/python bench/bench_tool_pool.py [--batch 64] [--workers 4] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
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

    from megarlhf.envs import EnvConfig, ToolRunner

    config = EnvConfig("calculator", parser="hermes", num_workers=args.workers)
    conversations = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "<tool_call>" + json.dumps(
        {"name": "calculator", "arguments": {"expression": f"({i} * 37 + 12) // 5 - sqrt({i})"}}) + "</tool_call>"}]
        for i in range(args.batch)]
    print(f"{args.batch} calculator calls per turn, {args.workers} workers, median of {args.repeats} turns")
    times, startup = {}, 0.0
    for kind in ("thread", "process"):
        runner = ToolRunner(config)
        runner.stateless = kind == "process"
        start = time.perf_counter()
        runner.step(runner.start([{}] * args.batch), conversations)  # warm-up (workers start)
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
    print(f"  thread {med['thread'] * 1e3:8.1f} ms   process {med['process'] * 1e3:8.1f} ms   process / thread "
          f"{med['process'] / med['thread']:5.2f}x   ({med['process'] / args.batch * 1e3:.2f} ms per call in "
          f"processes; first turn with worker start-up {startup:.2f} s)")


if __name__ == "__main__":
    main()
