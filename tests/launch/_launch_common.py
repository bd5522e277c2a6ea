"""Constants and helpers shared by the launch tests (fixtures are in conftest.py)."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "examples" / "recipes" / "tiny_ppo.yaml"
# Keys that measure time, not training; every other metric must match across launchers.
TIMING = ("time/", "throughput/", "perf/", "memory/")


def overrides(assets, run_dir) -> list[str]:
    model, train = assets
    return [f"model.path={model}", f"data.train_path={train}", f"logging.run_dir={run_dir}"]


def training_metrics(run_dir: Path) -> list[dict]:
    from megarlhf.records.metrics import read_metrics

    records = read_metrics(Path(run_dir) / "metrics.jsonl")
    return [{k: v for k, v in r.items() if not k.startswith(TIMING) and not k.endswith("_s")} for r in records]


def run_single_node_script(assets, run_dir: Path) -> list[dict]:
    """examples/torchrun/single_node.sh on 2 ranks; returns the run's training metrics."""
    env = {**os.environ, "NPROC": "2", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(["bash", str(ROOT / "examples" / "torchrun" / "single_node.sh"), str(RECIPE),
                           *overrides(assets, run_dir)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return training_metrics(run_dir)
