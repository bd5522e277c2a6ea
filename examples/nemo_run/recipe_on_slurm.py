"""Submit any megarlhf recipe to a Slurm cluster through NeMo-Run (one srun task per GPU).

    python examples/nemo_run/recipe_on_slurm.py examples/recipes/qwen2.5-7b_grpo.yaml \
        --nodes 4 --gpus-per-node 8 --partition batch --account my_account [--host login-node] \
        [--dry-run] -- model.path=/ckpt/Qwen2.5-7B-Instruct data.train_path=/data/math/train.jsonl

The recipe and overrides are loaded into a RunConfig first (the same loader as ``megarlhf train``), so a
bad key fails here, before anything is submitted; ``megarlhf plan`` is run on the layout and a plan that
does not fit stops the submission. ``--dry-run`` prints the sbatch script NeMo-Run would submit.
"""
import argparse
import sys
from pathlib import Path

from megarlhf.config import RunConfig, load_config
from megarlhf.launch import SlurmJob, megarlhf_task, run_experiment, slurm_executor
from megarlhf.launch import sbatch_script
from megarlhf.planner import Launch, plan_memory, resolve_shape


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-mem-gib", type=float, default=80.0)
    parser.add_argument("--partition", default=None)
    parser.add_argument("--account", default="default", help="Slurm account")
    parser.add_argument("--host", default=None, help="login node to submit through (SSH); default: this machine")
    parser.add_argument("--time", default="04:00:00")
    parser.add_argument("--job-dir", default="runs/nemo-slurm")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()

    config = load_config(RunConfig, args.recipe, args.overrides)
    world = args.nodes * args.gpus_per_node
    plan = plan_memory(config, resolve_shape(config.model.path)[0], Launch(world, args.gpu_mem_gib))
    if not plan.fits:
        print("megarlhf plan refuses this layout: " + "; ".join(plan.problems()), file=sys.stderr)
        return 1
    job_dir = Path(args.job_dir).absolute()
    task = megarlhf_task(config, job_dir / "job")
    executor = slurm_executor(SlurmJob(nodes=args.nodes, tasks_per_node=args.gpus_per_node,
                                       gpus_per_node=args.gpus_per_node, job_dir=job_dir / "slurm",
                                       partition=args.partition, account=args.account, time=args.time,
                                       host=args.host))
    if args.dry_run:
        print(sbatch_script(task, executor, name=Path(args.recipe).stem, home=job_dir / "home"))
        return 0
    print(run_experiment(Path(args.recipe).stem, task, executor, home=job_dir / "home", detach=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
