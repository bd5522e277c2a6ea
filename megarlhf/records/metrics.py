"""Run metrics: one JSON object per step in ``metrics.jsonl``, the same scalars to the run's trackers
(TensorBoard, W&B, MLflow: :mod:`megarlhf.records.tracking`), and a console progress line with the key figures.

Only global rank 0 writes. Steps are recorded every ``log_every`` steps (``logging.log_every``), and
always the last step and any record with evaluation metrics. A resumed run cuts ``metrics.jsonl`` back
to the steps its checkpoint had completed, so an interrupted-and-resumed run leaves the same file as an
uninterrupted one. A tracker that fails to log a step (a tracking server gone away) does not stop
training: it is reported and dropped for the rest of the run, and ``metrics.jsonl`` keeps every step.
"""
from __future__ import annotations

import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from megarlhf.records.tracking import close_trackers

CONSOLE_KEYS = ("reward/mean", "eval/accuracy", "actor/pg_loss", "actor/ppo_kl", "response_len/mean",
                "time/step_s")


def mean_and_std(count: float, total: float, total_sq: float) -> tuple[float, float]:
    """Mean and (population) standard deviation of values given as count, sum and sum of squares, the
    form in which data-parallel replicas reduce them in one collective."""
    mean = total / count
    return mean, max(total_sq / count - mean * mean, 0.0) ** 0.5


def read_metrics(path: str | Path) -> list[dict]:
    """Every record of a ``metrics.jsonl`` file, in order (an absent file has none)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_records_after(path: str | Path, step: int) -> None:
    """Keeps the records of a JSONL file (each with a ``"step"``) up to ``step`` (none at -1), atomically:
    a resumed run continues from its checkpoint's step."""
    path = Path(path)
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)


def _finite_or_none(value):
    value = float(value)
    return value if math.isfinite(value) else None


def _duration(seconds: float) -> str:
    """``"42 s"``, ``"3 min 05 s"``, ``"2 h 07 min"``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds // 60 % 60:02d} min"


class MetricsRecorder:
    """Records per-step metrics for a run directory (a no-op on ranks other than 0)."""

    def __init__(self, run_dir: str | Path, *, total_steps: int, trackers: Sequence = (), rank: int = 0,
                 resume_after_step: int | None = None, console_keys: Iterable[str] = CONSOLE_KEYS,
                 stream=None, log_every: int = 1):
        """``trackers``: opened :mod:`megarlhf.records.tracking` backends (rank 0's; closed by :meth:`close`)."""
        if not (isinstance(log_every, int) and log_every >= 1):
            raise ValueError(f"MetricsRecorder: log_every must be an int >= 1, got {log_every!r}")
        self.active = rank == 0
        self.total_steps = total_steps
        self.log_every = log_every
        self.console_keys = tuple(console_keys)
        self.stream = stream or sys.stdout
        self.path = Path(run_dir) / "metrics.jsonl"
        self.trackers = list(trackers)
        self._start = time.time()
        self._first_step = 0 if resume_after_step is None else resume_after_step + 1  # this process's first
        if not self.active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_after_step)

    def _truncate_after(self, step: int | None) -> None:
        if step is not None:
            truncate_records_after(self.path, step)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Appends ``{"step": step, **metrics}`` if the step is due (module docstring); non-finite values
        are written as null."""
        due = step % self.log_every == 0 or step >= self.total_steps - 1 or any(k.startswith("eval/") for k in metrics)
        if not self.active or not due:
            return
        record = {"step": step, **{k: _finite_or_none(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {k: float(v) for k, v in metrics.items()}
        for tracker in list(self.trackers):
            try:
                tracker.log(step, scalars)
            except Exception as err:  # noqa: BLE001 - any backend failure; metrics.jsonl has the step
                # dropped, not retried: a tracking server that is gone would cost each step its timeouts
                self.trackers.remove(tracker)
                warnings.warn(f"{type(tracker).__name__} could not log step {step} ({type(err).__name__}: "
                              f"{err}); it is closed as failed and dropped for the rest of the run, "
                              "metrics.jsonl keeps every step", stacklevel=2)
                close_trackers([tracker], failed=True)  # its MLflow run FAILED, not left RUNNING
        self._print(step, record)

    def _print(self, step: int, record: dict) -> None:
        """One progress line: the step numbered as in metrics.jsonl (from 0), how many of the steps are done,
        the key figures, the time so far and the estimated time left (from this process's steps)."""
        done = min(step + 1, self.total_steps)  # the final evaluation is recorded as step == total_steps
        width = 20
        filled = int(width * done / max(self.total_steps, 1))
        elapsed = time.time() - self._start
        figures = "  ".join(f"{k}={record[k]:.4g}" for k in self.console_keys if record.get(k) is not None)
        bar = "#" * filled + "." * (width - filled)
        label = f"step {step}" if step < self.total_steps else "final eval"
        ran = done - self._first_step
        left = self.total_steps - done
        eta = f", {_duration(elapsed / ran * left)} left" if ran > 0 and left > 0 else ""
        print(f"[{bar}] {label} ({done}/{self.total_steps} done)  {figures}  ({_duration(elapsed)}{eta})",
              file=self.stream, flush=True)

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        close_trackers(trackers)


def plot_curves(metrics_path: str | Path, out_png: str | Path,
                keys: Iterable[str] = ("reward/mean", "eval/accuracy")) -> Path:
    """Draws one panel per key (steps on x) from ``metrics.jsonl`` into a PNG; keys never logged are skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    series = {k: [(r["step"], r[k]) for r in records if r.get(k) is not None] for k in keys}
    series = {k: v for k, v in series.items() if v}
    if not series:
        raise ValueError(f"{metrics_path} has none of the metrics {list(keys)} to plot")
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 3.5), squeeze=False)
    for ax, (key, points) in zip(axes[0], series.items()):
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o" if len(points) < 30 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
