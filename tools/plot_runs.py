"""Draws the same metrics of several runs side by side: one panel per metric, one line per run.

    python tools/plot_runs.py runs/a runs/b --labels "lr 5e-6" "lr 2e-5" \
        --keys reward/mean eval/accuracy actor/kl_loss --out curves.png

Reads each run directory's ``metrics.jsonl``; a metric a run never logged is left out of its panel.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from megarlhf.records.metrics import read_metrics


def plot_runs(run_dirs: list[Path], labels: list[str], keys: list[str], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = {label: read_metrics(run / "metrics.jsonl") for run, label in zip(run_dirs, labels)}
    if not any(records.values()):
        raise SystemExit(f"none of {[str(r) for r in run_dirs]} has a metrics.jsonl with records")
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for label, rows in records.items():
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, marker="o" if len(points) < 12 else None, label=label)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (each with metrics.jsonl)")
    parser.add_argument("--labels", nargs="+", help="one per run (default: the directory names)")
    parser.add_argument("--keys", nargs="+", default=["reward/mean", "eval/accuracy"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    labels = args.labels or [run.name for run in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"{len(args.runs)} runs but {len(labels)} labels")
    print(plot_runs(args.runs, labels, args.keys, args.out))


if __name__ == "__main__":
    main()
