"""The sbatch scripts and NeMo-Run's SlurmExecutor against a real single-node Slurm started here.

Marked ``slurm`` (left out of the default run): it needs root and apt-get to install and start Slurm
(tests/launch/_local_slurm.py) and a few minutes; where that is impossible it is skipped, not failed.
Each submission runs the tiny recipe on 2 ranks (``--gpus-per-node=0`` overrides the scripts' GPU
request on this CPU machine) and must give the same metrics as the torchrun script with the same seed.
"""
import os
import subprocess
import sys
import time

import pytest

from _launch_common import RECIPE, ROOT, overrides, training_metrics
from _local_slurm import SlurmInstallError, ensure_local_slurm, slurm_unavailable

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def slurm():
    reason = slurm_unavailable()
    if reason:
        pytest.skip(f"no local Slurm: {reason}")
    try:
        ensure_local_slurm()
    except SlurmInstallError as exc:  # no package mirror: nothing to test against (a start failure fails)
        pytest.skip(str(exc))


def _sbatch(script: str, flags: list[str], args: list[str], cwd, env: dict) -> str:
    (cwd / "logs").mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "MEGARLHF_ROOT": str(ROOT), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
                "PYTHONWARNINGS": "ignore", **env}
    proc = subprocess.run(["sbatch", "--wait", "--parsable", "--job-name=megarlhf-test", *flags,
                           str(ROOT / "examples" / "slurm" / script), *args],
                          cwd=cwd, env=full_env, capture_output=True, text=True, timeout=900)
    logs = "\n".join(p.read_text() for p in (cwd / "logs").glob("*.out"))
    assert proc.returncode == 0, f"sbatch {script} failed ({proc.returncode}): {proc.stderr}\n{logs[-6000:]}"
    return logs


def test_srun_sbatch_matches_torchrun(slurm, tiny_assets, tmp_path, torchrun_reference):
    run_dir = tmp_path / "run"
    logs = _sbatch("train_srun.sbatch", ["--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0"],
                   [str(RECIPE), *overrides(tiny_assets, run_dir)], tmp_path, {})
    assert "2 ranks on 1 node(s)" in logs
    assert training_metrics(run_dir) == torchrun_reference


def test_torchrun_sbatch_matches_torchrun(slurm, tiny_assets, tmp_path, torchrun_reference):
    run_dir = tmp_path / "run"
    _sbatch("train_torchrun.sbatch", ["--cpus-per-task=2", "--gpus-per-node=0"],
            [str(RECIPE), *overrides(tiny_assets, run_dir)], tmp_path, {"NPROC_PER_NODE": "2"})
    assert training_metrics(run_dir) == torchrun_reference


def test_nemo_run_slurm_executor_matches_torchrun(slurm, tiny_assets, tmp_path, torchrun_reference, monkeypatch):
    from megarlhf.config import RunConfig, load_config
    from megarlhf.launch import SlurmJob, megarlhf_task, run_experiment, slurm_executor

    monkeypatch.setattr(sys, "stdin", open("/dev/null"))  # NeMo-Run's local tunnel reads stdin through invoke
    run_dir = tmp_path / "run"
    config = load_config(RunConfig, RECIPE, overrides(tiny_assets, run_dir))
    task = megarlhf_task(config, tmp_path / "job", python=sys.executable)
    executor = slurm_executor(SlurmJob(nodes=1, tasks_per_node=2, job_dir=tmp_path / "slurm", account="local",
                                       time="00:20:00"), env={"PYTHONWARNINGS": "ignore"})
    # detached: NeMo-Run's attached monitoring polls sacct, which a Slurm without accounting storage
    # (this one) does not answer, and it cancels the job after 30 failed polls; squeue is watched instead
    assert run_experiment("tiny-ppo-slurm", task, executor, home=tmp_path / "home", detach=True) == "SUBMITTED"
    deadline = time.monotonic() + 900
    while subprocess.run(["squeue", "-h", "-n", "local-local.tiny-ppo-slurm"], capture_output=True,
                         text=True).stdout.strip():
        assert time.monotonic() < deadline, "the NeMo-Run Slurm job did not finish in 15 minutes"
        time.sleep(5)
    assert training_metrics(run_dir) == torchrun_reference
