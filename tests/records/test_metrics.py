"""megarlhf.records.metrics: jsonl records, TensorBoard scalars, resume truncation, console line, curves PNG."""
import io
import math
from pathlib import Path

import pytest

from megarlhf.config.train import LoggingConfig
from megarlhf.records.metrics import MetricsRecorder, plot_curves, read_metrics
from megarlhf.records.tracking import open_trackers


def test_records_jsonl_tensorboard_and_console(tmp_path):
    out = io.StringIO()
    trackers = open_trackers(LoggingConfig(backends=["tensorboard"]), tmp_path, {}, -1)
    rec = MetricsRecorder(tmp_path, total_steps=2, trackers=trackers, stream=out)
    rec.log(0, {"reward/mean": 0.25, "actor/pg_loss": -0.5, "bad": math.nan})
    rec.log(1, {"reward/mean": 0.75, "eval/accuracy": 0.5})
    rec.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 0, "actor/pg_loss": -0.5, "bad": None, "reward/mean": 0.25},
        {"step": 1, "eval/accuracy": 0.5, "reward/mean": 0.75}]
    lines = out.getvalue().splitlines()
    # numbered as metrics.jsonl numbers them; the first line has a time-left estimate, the last none
    assert "step 0 (1/2 done)" in lines[0] and "reward/mean=0.25" in lines[0] and " left)" in lines[0]
    assert "step 1 (2/2 done)" in lines[1] and "eval/accuracy=0.5" in lines[1] and "left" not in lines[1]
    # bench/bench_vs_trl.py times steps by these lines (seen failing: its pattern wanted the old "step N/M")
    import importlib.util

    path = Path(__file__).parents[2] / "bench" / "bench_vs_trl.py"
    spec = importlib.util.spec_from_file_location("bench_vs_trl", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert [bench.STEP_LINE.search(line).group(1) for line in lines] == ["1", "2"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(0, 0.25), (1, 0.75)]


def test_resume_truncates_steps_after_the_checkpoint(tmp_path):
    rec = MetricsRecorder(tmp_path, total_steps=4, stream=io.StringIO())
    for step in range(3):
        rec.log(step, {"x": float(step)})
    resumed = MetricsRecorder(tmp_path, total_steps=4, resume_after_step=0,
                              stream=io.StringIO())
    resumed.log(1, {"x": 10.0})
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(0, 0.0), (1, 10.0)]


def test_progress_estimates_time_left_from_this_process_steps(tmp_path, monkeypatch):
    clock = iter([100.0, 130.0, 160.0])  # created at 100 s; resumed after step 3, two steps of 30 s each
    monkeypatch.setattr("megarlhf.records.metrics.time.time", lambda: next(clock))
    out = io.StringIO()
    rec = MetricsRecorder(tmp_path, total_steps=10, stream=out, resume_after_step=3)
    rec.log(4, {"x": 1.0})
    rec.log(5, {"x": 1.0})
    first, second = out.getvalue().splitlines()
    assert "step 4 (5/10 done)" in first and "(30 s, 2 min 30 s left)" in first  # 5 steps left at 30 s
    assert "step 5 (6/10 done)" in second and "(1 min 00 s, 2 min 00 s left)" in second


def test_other_ranks_write_nothing(tmp_path):
    rec = MetricsRecorder(tmp_path / "run", total_steps=1, rank=1)
    rec.log(0, {"x": 1.0})
    assert not (tmp_path / "run").exists()


def test_plot_curves_writes_png_and_refuses_empty(tmp_path):
    rec = MetricsRecorder(tmp_path, total_steps=3, stream=io.StringIO())
    for step in range(3):
        rec.log(step, {"reward/mean": step / 3, **({"eval/accuracy": 0.5} if step == 2 else {})})
    png = plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="none of the metrics"):
        plot_curves(tmp_path / "metrics.jsonl", tmp_path / "x.png", keys=["absent"])


def test_log_every_records_due_steps_the_last_and_evaluations(tmp_path):
    rec = MetricsRecorder(tmp_path, total_steps=7, stream=io.StringIO(), log_every=3)
    for step in range(7):
        rec.log(step, {"x": float(step), **({"eval/accuracy": 0.5} if step == 4 else {})})
    rec.log(7, {"eval/accuracy": 0.75})  # the final evaluation
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 3, 4, 6, 7]
    with pytest.raises(ValueError, match="log_every must be an int >= 1"):
        MetricsRecorder(tmp_path, total_steps=1, log_every=0)


def test_mean_and_std_from_count_sum_and_sum_of_squares():
    from megarlhf.records.metrics import mean_and_std

    assert mean_and_std(4, 1 + 2 + 3 + 4, 1 + 4 + 9 + 16) == (2.5, 1.25 ** 0.5)  # hand-worked
    values = [0.1, 0.1, 0.1]  # E[x^2] - E[x]^2 rounds below zero here: the std is clamped to 0, not NaN
    mean, std = mean_and_std(3, sum(values), sum(v * v for v in values))
    assert sum(v * v for v in values) / 3 - mean * mean < 0 and std == 0.0
