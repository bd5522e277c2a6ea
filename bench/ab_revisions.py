"""A/B benchmark: one recipe at two git revisions of megarlhf, one after the other in one run (not part
of ``make bench``: it needs the revisions, a recipe and its data).

Each revision is checked out into its own git worktree (under ``--out``) and runs
``megarlhf train RECIPE`` for ``--steps`` steps on 2 ranks (torchrun) with the same overrides, data and
model directory (paths are resolved against this checkout, so both revisions read the same files), in
the same Python environment. From each run's ``metrics.jsonl`` it prints, side by side:

* s/step, train s/step, rollout s/step and weight-sync s/step: means over steps 1..N-1 (step 0 carries
  the engines' warm-up and the step-0 gate), and the ratio after/before;
* the learning numbers, which a change of the hot path must leave alone: every step's reward mean, the
  step-0 log-prob gap (max and mean), actor loss and grad norm, and whether they are equal to the last bit.

Run it where nothing else loads the machine: the wall times are what is compared.

  .venv/bin/python bench/ab_revisions.py --before 0876bf5 --after HEAD \\
      --recipe examples/recipes/smollm2_grpo_arithmetic.yaml --steps 4 \\
      model.path=checkpoints/smollm2-135m-instruct data.train_path=data/smollm2_sums/train.jsonl \\
      data.eval_path=data/smollm2_sums/heldout.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMES = (("s/step", "time/step_s"), ("train s/step", "time/train_s"), ("rollout s/step", "time/rollout_s"),
         ("weight sync s/step", "time/weight_sync_s"))
LEARNING = ("reward/mean", "mismatch/step0_logprob_gap_max", "mismatch/step0_logprob_gap_mean", "actor/loss",
            "actor/grad_norm")


def absolute_overrides(overrides: list[str]) -> list[str]:
    """``key=value`` overrides whose value names an existing file or folder of this checkout, made absolute
    (the runs start in their worktrees)."""
    out = []
    for item in overrides:
        key, _, value = item.partition("=")
        out.append(f"{key}={(ROOT / value).resolve()}" if value and (ROOT / value).exists() else item)
    return out


def worktree(revision: str, out: Path) -> Path:
    commit = subprocess.run(["git", "rev-parse", "--short", revision], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    path = out / f"tree-{commit}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=ROOT, check=True,
                       capture_output=True)
    return path


def run(tree: Path, recipe: str, steps: int, overrides: list[str], run_dir: Path) -> tuple[list[dict], float]:
    """Trains from scratch in ``run_dir``; returns the metrics records and the wall seconds."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "-m", "megarlhf", "train",
               str((ROOT / recipe).resolve()), f"train.steps={steps}", f"logging.run_dir={run_dir}",
               "checkpoint.resume=none", f"checkpoint.every={steps}", "eval.every=0", *overrides]
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{tree.name}: the run failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in records if "time/step_s" in r], seconds


def mean_after_step0(records: list[dict], key: str) -> float:
    values = [r[key] for r in records[1:] if key in r]
    return sum(values) / len(values) if values else float("nan")


def report(names: list[str], results: list[tuple[list[dict], float]]) -> None:
    width = 26
    print(f"{'':<{width}}" + "".join(f"{n:>14}" for n in names) + f"{'after/before':>14}")
    for label, key in TIMES:
        values = [mean_after_step0(records, key) for records, _ in results]
        print(f"{label:<{width}}" + "".join(f"{v:>14.2f}" for v in values) + f"{values[1] / values[0]:>14.3f}")
    print(f"{'wall s (whole run)':<{width}}" + "".join(f"{s:>14.1f}" for _, s in results))
    for key in LEARNING:
        rows = [[r.get(key) for r in records] for records, _ in results]
        for step in range(max(len(row) for row in rows)):
            cells = [row[step] if step < len(row) else None for row in rows]
            if all(c is None for c in cells):
                continue
            print(f"{key + f' @{step}':<{width}}" + "".join(f"{c:>14.6g}" if c is not None else f"{'-':>14}"
                                                           for c in cells))
    print(f"learning numbers equal to the last bit at every step: {_identical(results)}")


def _identical(results: list[tuple[list[dict], float]]) -> str:
    """"yes", or the first value of LEARNING that differs between the two runs (exact float comparison)."""
    (before, _), (after, _) = results
    if len(before) != len(after):
        return f"no: {len(before)} against {len(after)} steps"
    for step, (a, b) in enumerate(zip(before, after)):
        for key in LEARNING:
            if a.get(key) != b.get(key):
                return f"no: {key} at step {step}: {a.get(key)!r} against {b.get(key)!r}"
    return "yes"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="runs/bench_ab")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for both runs")
    args = parser.parse_args()
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    overrides, names, results = absolute_overrides(args.overrides), [], []
    for revision in (args.before, args.after):
        tree = worktree(revision, out)
        names.append(tree.name.removeprefix("tree-"))
        print(f"running {args.recipe} at {revision} ({names[-1]}), {args.steps} steps ...", flush=True)
        results.append(run(tree, args.recipe, args.steps, overrides, out / f"run-{names[-1]}"))
    report(names, results)


if __name__ == "__main__":
    main()
