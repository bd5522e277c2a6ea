"""NeMo-Run: the Python-described experiment (examples/nemo_run/tiny_ppo.py) builds the same RunConfig
as the YAML recipe, runs through run.LocalExecutor with the torchrun launcher on 2 ranks, and gives the
same metrics as the torchrun script for the same seed; the SlurmExecutor's sbatch script is inspected."""
import importlib.util
import sys

import pytest

from _launch_common import RECIPE, ROOT, overrides, training_metrics
from megarlhf.config import RunConfig, load_config
from megarlhf.launch import SlurmJob, local_executor, megarlhf_task, run_experiment, sbatch_script, slurm_executor


def _example():
    spec = importlib.util.spec_from_file_location("tiny_ppo_example", ROOT / "examples" / "nemo_run" / "tiny_ppo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_python_experiment_equals_the_recipe(tiny_assets, tmp_path):
    model, train = tiny_assets
    built = _example().experiment_config(str(model), str(train), str(tmp_path / "run"))
    assert built == load_config(RunConfig, RECIPE, overrides(tiny_assets, tmp_path / "run"))


@pytest.mark.slow  # two real trainings (~3 min on 2 cores)
def test_local_executor_torchrun_matches_torchrun_script(tiny_assets, tmp_path, torchrun_reference):
    model, train = tiny_assets
    config = _example().experiment_config(str(model), str(train), str(tmp_path / "run"))
    task = megarlhf_task(config, tmp_path / "job", python=sys.executable)
    state = run_experiment("tiny-ppo", task, local_executor(2, env={"PYTHONWARNINGS": "ignore"}),
                           home=tmp_path / "home")
    assert state == "SUCCEEDED"
    assert load_config(RunConfig, tmp_path / "job" / "config.yaml") == config  # what the ranks loaded
    assert training_metrics(tmp_path / "run") == torchrun_reference


def test_slurm_executor_script(tiny_assets, tmp_path, monkeypatch):
    # NeMo-Run's local tunnel runs commands through invoke, which reads stdin; pytest's captured stdin refuses
    monkeypatch.setattr(sys, "stdin", open("/dev/null"))
    config = load_config(RunConfig, RECIPE, overrides(tiny_assets, tmp_path / "run"))
    task = megarlhf_task(config, tmp_path / "job")
    executor = slurm_executor(SlurmJob(nodes=4, tasks_per_node=8, gpus_per_node=8, job_dir=tmp_path / "slurm",
                                       account="acct", partition="batch", time="01:00:00"))
    script = sbatch_script(task, executor, name="tiny", home=tmp_path / "home")
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=batch", "#SBATCH --requeue", "#SBATCH --time=01:00:00",
                 "export MASTER_PORT=", f"-m megarlhf train {tmp_path / 'job' / 'config.yaml'}"):
        assert line in script, f"{line!r} missing from:\n{script}"
    assert script.count("srun ") >= 1 and "torchrun" not in script  # one task per GPU, started by srun


def test_nemo_run_path_gotcha_is_refused(tiny_assets, tmp_path):
    config = load_config(RunConfig, RECIPE, overrides(tiny_assets, tmp_path / "run"))
    with pytest.raises(ValueError, match="/nemo_run"):
        megarlhf_task(config, tmp_path / "nemo_run" / "job")
