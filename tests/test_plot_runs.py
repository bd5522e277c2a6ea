"""tools/plot_runs.py: several runs' metrics in one PNG; runs without records are refused."""
import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "plot_runs.py"


def _run(tmp_path, name, rows):
    run = tmp_path / name
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_plots_two_runs_and_refuses_runs_without_records(tmp_path):
    a = _run(tmp_path, "a", [{"step": 0, "reward/mean": 0.1, "eval/accuracy": 0.2}, {"step": 1, "reward/mean": 0.3}])
    b = _run(tmp_path, "b", [{"step": 0, "reward/mean": 0.2}])
    out = tmp_path / "both.png"
    done = subprocess.run([sys.executable, str(TOOL), str(a), str(b), "--labels", "A", "B", "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = subprocess.run([sys.executable, str(TOOL), str(empty), "--out", str(tmp_path / "x.png")],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "has a metrics.jsonl with records" in refused.stderr
    mismatched = subprocess.run([sys.executable, str(TOOL), str(a), "--labels", "A", "B", "--out", str(out)],
                                capture_output=True, text=True)
    assert mismatched.returncode != 0 and "1 runs but 2 labels" in mismatched.stderr
