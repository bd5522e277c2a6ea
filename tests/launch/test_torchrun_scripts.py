"""examples/torchrun: the single-node script runs a real 2-rank training; the multi-node script's c10d
rendezvous starts its ranks and passes the recipe and overrides through."""
import os
import subprocess

import pytest

from _launch_common import RECIPE, ROOT


@pytest.mark.slow  # a real 2-rank training (~1.5 min on 2 cores)
def test_single_node_script_trains(torchrun_reference):
    assert [r["step"] for r in torchrun_reference] == [0, 1]
    for record in torchrun_reference:
        assert {"reward/mean", "actor/pg_loss", "actor/grad_norm"} <= set(record)


def test_multi_node_script_rendezvous(tiny_assets, tmp_path):
    model, train = tiny_assets
    env = {**os.environ, "NNODES": "1", "NPROC": "2", "RDZV_HOST": "127.0.0.1", "RDZV_PORT": "29517",
           "RDZV_ID": "test", "COMMAND": "plan", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(ROOT / "examples" / "torchrun" / "multi_node.sh"), str(RECIPE),
                           f"model.path={model}", f"data.train_path={train}", "--device", "cpu", "--gpus", "2"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("fits: peak") == 2  # both ranks ran the command with the recipe's overrides


def test_missing_arguments_are_reported():
    proc = subprocess.run(["bash", str(ROOT / "examples" / "torchrun" / "multi_node.sh"), str(RECIPE)],
                          env={k: v for k, v in os.environ.items() if k not in ("NNODES", "RDZV_HOST")},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "NNODES" in proc.stderr
