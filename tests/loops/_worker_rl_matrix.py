"""Rank script for tests/loops/test_rl_matrix.py: several short RL runs of the real driver in one
torchrun launch (2 ranks, data parallel), each with its own recipe overrides; records each run's metrics.

Usage: _worker_rl_matrix.py RECIPE CASES_JSON OUT_DIR. CASES_JSON maps a case name to its overrides.
The runs use the fake rollout backend (no engine start per run, one forward per batch), so many
configurations fit in one launch; the vLLM and transformers backends run through the same driver in
test_rl.py and test_moe_runs.py.
"""
import json
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from megarlhf.config import RunConfig, load_config
from megarlhf.records.metrics import read_metrics
from megarlhf.testing.launch import write_rank_result
from megarlhf.loops.rl import train_rl


def main() -> None:
    recipe, cases, out_dir = sys.argv[1], json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])
    results = {}
    for name, overrides in cases.items():
        run_dir = out_dir / name
        start = time.perf_counter()
        try:
            train_rl(load_config(RunConfig, recipe, [*overrides, f"logging.run_dir={run_dir}"]))
            results[name] = {"metrics": read_metrics(run_dir / "metrics.jsonl"), "error": None}
        except Exception:  # reported per case; the other cases still run (every rank fails together)
            results[name] = {"metrics": [], "error": traceback.format_exc()[-3000:]}
        results[name]["seconds"] = time.perf_counter() - start
    write_rank_result(out_dir, dist.get_rank(), results)


if __name__ == "__main__":
    main()
