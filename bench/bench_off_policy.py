"""Benchmark: synchronous vs one-step off-policy GRPO, 1 trainer rank + 1 engine rank (disaggregated).

Runs the CPU demo's GRPO recipe (examples/recipes/demo_grpo.yaml) from the demo's answer-first SFT
model twice in one go, ``rollout.max_staleness=0`` then ``=1``, the same steps, seeds and data, and
prints side by side: seconds per step (mean over steps 1..N-1: step 0 includes engine start-up
effects and is the same in both), its parts (rollout wait, training), the overlap achieved, the ratio
off-policy / synchronous, and the reward (mean over the last 5 steps, and per step); writes both
reward curves into one PNG.

Usage:  .venv/bin/python bench/bench_off_policy.py [--model runs/demo/sft_answer_first/hf]
            [--data runs/demo/data] [--steps 20] [--out runs/bench_off_policy]
(``make demo`` makes the model and data.) Every rank runs with one thread, so the engine rank and the
trainer rank each have a core of their own.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(args, staleness: int) -> list[dict]:
    from megarlhf.records.metrics import read_metrics

    run_dir = Path(args.out).absolute() / f"staleness{staleness}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "megarlhf", "train", str(ROOT / "examples/recipes/demo_grpo.yaml"), f"model.path={args.model}",
           f"data.train_path={Path(args.data) / 'train.jsonl'}", f"logging.run_dir={run_dir}",
           "rollout.placement={mode: disaggregated, num_engine_ranks: 1}", f"rollout.max_staleness={staleness}",
           f"train.steps={args.steps}", "eval.every=0", "checkpoint.every=0", "checkpoint.resume=none",
           "logging.backends=[]"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "VLLM_LOGGING_LEVEL": "WARNING"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "time/step_s" in r]


def mean(values) -> float:
    values = list(values)
    return sum(values) / max(len(values), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "runs/demo/sft_answer_first/hf"))
    parser.add_argument("--data", default=str(ROOT / "runs/demo/data"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "runs/bench_off_policy"))
    args = parser.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        sys.exit(f"no model at {args.model}: run `make demo` first (or pass --model / --data)")
    results = {s: run(args, s) for s in (0, 1)}
    rows = {}
    for s, records in results.items():
        later = records[1:]
        rows[s] = {"step_s": mean(r["time/step_s"] for r in later),
                   "rollout_s": mean(r["time/rollout_s"] for r in later),
                   "train_s": mean(r["time/train_s"] for r in later),
                   "overlap_s": mean(r.get("time/rollout_overlap_s", 0.0) for r in later),
                   "reward_last5": mean(r["reward/mean"] for r in records[-5:]),
                   "rewards": [round(r["reward/mean"], 4) for r in records]}
    sync, off = rows[0], rows[1]
    print(f"GRPO, demo recipe, {args.steps} steps, 1 trainer + 1 engine rank (CPU, 1 thread each)")
    print(f"{'':28s}{'synchronous':>14s}{'off-policy':>14s}{'ratio':>8s}")
    for key, label in (("step_s", "s/step (steps 1..N-1)"), ("rollout_s", "  collect (wait + score)"),
                       ("train_s", "  train"), ("overlap_s", "  generation overlapped")):
        ratio = off[key] / sync[key] if sync[key] else float("nan")
        print(f"{label:28s}{sync[key]:14.3f}{off[key]:14.3f}{ratio:8.2f}")
    print(f"{'reward, mean of last 5':28s}{sync['reward_last5']:14.3f}{off['reward_last5']:14.3f}")
    print("reward per step  sync:", sync["rewards"])
    print("reward per step  off: ", off["rewards"])
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for s, label in ((0, "synchronous"), (1, "one-step off-policy")):
        axes[0].plot(rows[s]["rewards"], label=label)
        axes[1].plot([r["time/step_s"] for r in results[s]], label=label)
    for ax, title in zip(axes, ("reward/mean", "time/step_s")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "off_policy.png", dpi=100)
    print(f"curves: {out / 'off_policy.png'}")


if __name__ == "__main__":
    main()
