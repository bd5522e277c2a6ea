"""A NeMo-Run experiment described in Python: PPO (GAE critic) on a tiny model, 2 ranks, run locally or on Slurm.

The experiment is a RunConfig built from megarlhf's own dataclasses (the same ones the YAML recipes
fill; this one equals examples/recipes/tiny_ppo.yaml with the same paths), handed to
megarlhf.launch, which saves it into the job directory and runs ``python -m megarlhf train`` on every
rank through NeMo-Run:

    python examples/nemo_run/tiny_ppo.py --model M --train-data D.jsonl --out runs/nr            # local, torchrun
    python examples/nemo_run/tiny_ppo.py ... --executor slurm [--partition P] [--account A]    # sbatch (srun)

Make the model and data with tools/make_tiny_model.py and megarlhf.data.synthetic.write_arithmetic_task.
"""
import argparse
from pathlib import Path

from megarlhf.config.algorithm import KLConfig
from megarlhf.config import (AlgorithmConfig, CheckpointConfig, LoggingConfig, ModelConfig, OptimConfig,
                             RolloutConfig, RunConfig, TrainConfig)
from megarlhf.config.data import DataConfig
from megarlhf.launch import SlurmJob, local_executor, megarlhf_task, run_experiment, slurm_executor
from megarlhf.config.reward import RewardConfig, RewardSpec


def experiment_config(model_path: str, train_path: str, run_dir: str) -> RunConfig:
    return RunConfig(
        model=ModelConfig(path=model_path, dtype="float32"),
        data=DataConfig(train_path=train_path, chat_template="never", max_prompt_length=96),
        rollout=RolloutConfig(n_samples=4, max_new_tokens=12, temperature=1.0, kv_cache_mb=64),
        algorithm=AlgorithmConfig(estimator="gae", kl=KLConfig(coef=0.01)),
        optim=OptimConfig(lr=1.0e-4),
        train=TrainConfig(steps=2, global_batch_size=4, micro_batch_tokens=512),
        reward=RewardConfig(functions=[RewardSpec("exact_match")], num_workers=1),
        checkpoint=CheckpointConfig(every=0, resume="auto"),
        logging=LoggingConfig(run_dir=run_dir, backends=[]),
        seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--train-data", required=True)
    parser.add_argument("--out", required=True, help="job directory (run dir, NeMo-Run state, logs)")
    parser.add_argument("--executor", choices=("local", "slurm"), default="local")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (per node on Slurm)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--partition", default=None)
    parser.add_argument("--account", default="default", help="Slurm account")
    args = parser.parse_args()

    out = Path(args.out).absolute()
    config = experiment_config(args.model, args.train_data, str(out / "run"))
    task = megarlhf_task(config, out / "job")
    executor = (local_executor(args.nproc) if args.executor == "local" else
                slurm_executor(SlurmJob(nodes=args.nodes, tasks_per_node=args.nproc, job_dir=out / "slurm",
                                        partition=args.partition, account=args.account, time="00:30:00")))
    state = run_experiment("tiny-ppo", task, executor, home=out / "home")
    print(f"tiny-ppo: {state}; metrics in {out / 'run' / 'metrics.jsonl'}")


if __name__ == "__main__":
    main()
