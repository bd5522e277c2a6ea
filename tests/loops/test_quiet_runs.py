"""An RL run launched as the README shows (``megarlhf train --nproc-per-node 2``, vLLM engines) prints
megarlhf's own lines only: the progress, the export, and each warning of megarlhf's once; what vLLM,
Megatron and torch log is in ``<run_dir>/logs/rank<N>.log``. (Before: ~106 lines for 2 steps, 60+ of them
vLLM's INFO on both ranks, progress bars and library deprecation warnings.)"""
import json
import os
import subprocess
import sys

from _rl_recipe import write_recipe


def test_an_rl_run_prints_only_megarlhf_lines_and_logs_the_rest(rl_assets, tmp_path):
    recipe = write_recipe(tmp_path / "grpo.yaml", rl_assets, "grpo", tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONWARNINGS")}
    done = subprocess.run([sys.executable, "-m", "megarlhf", "train", str(recipe), "--nproc-per-node", "2"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out, err = done.stdout.splitlines(), done.stderr.splitlines()
    assert all(line.startswith("megarlhf: warning: ") for line in err), done.stderr
    assert len(err) == len(set(err))  # each once, not once per rank
    progress = [line for line in out if line.startswith("[")]
    assert len(progress) == 3 and "step 0 (1/2 done)" in progress[0] and "final eval" in progress[2]
    others = [line for line in out if not line.startswith("[")]
    assert others == [f"exported the trained policy to {tmp_path / 'run' / 'hf'}"]
    logs = {path.name: path.read_text() for path in (tmp_path / "run" / "logs").iterdir()}
    assert set(logs) == {"rank0.log", "rank1.log"}
    assert all(" INFO vllm" in text for text in logs.values())  # vLLM's lines are kept, not lost
    # every record carries the ranks' resident memory (the largest, the mean, rank 0's)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records and all(0.2 < r["memory/rss_gb_rank0"] <= r["memory/rss_gb_max"] < 20 for r in records)
    assert all(r["memory/rss_gb_mean"] <= r["memory/rss_gb_max"] for r in records)
