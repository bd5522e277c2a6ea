"""Launching megarlhf where users run: NeMo-Run experiments (:mod:`.nemo`). The torchrun and Slurm
scripts live in examples/torchrun and examples/slurm; they need no Python helper."""
from megarlhf.launch.nemo import (SlurmJob, local_executor, megarlhf_task, run_experiment, sbatch_script,
                                  slurm_executor)

__all__ = ["SlurmJob", "local_executor", "megarlhf_task", "run_experiment", "sbatch_script", "slurm_executor"]
