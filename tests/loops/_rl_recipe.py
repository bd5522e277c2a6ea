"""The tiny RL recipe the driver tests run (2 ranks, a few steps), the rank script that runs it, and a
launcher that kills a run as soon as a checkpoint is complete (the resume tests)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from megarlhf.checkpoint.distributed import is_complete_checkpoint

WORKER = Path(__file__).with_name("_worker_rl.py")
RECIPE = """
model: {path: MODEL, dtype: float32}
data: {train_path: DATA/train.jsonl, eval_path: DATA/heldout.jsonl, max_prompt_length: 96, chat_template: never}
rollout: {n_samples: 4, max_new_tokens: 12, temperature: 1.0, kv_cache_mb: 64}
algorithm: {estimator: ESTIMATOR, kl: {coef: 0.01}}
optim: {lr: 1.0e-4, use_distributed_optimizer: true}
train: {steps: 2, global_batch_size: 4, micro_batch_tokens: 512}
reward: {functions: [{name: exact_match}]}
eval: {every: 2, max_prompts: 4}
checkpoint: {every: 0}
logging: {run_dir: RUN, backends: [tensorboard]}
"""


def write_recipe(path: Path, assets: tuple[Path, Path], estimator: str, run_dir: Path) -> Path:
    model, data = assets
    path.write_text(RECIPE.replace("MODEL", str(model)).replace("DATA", str(data))
                    .replace("ESTIMATOR", estimator).replace("RUN", str(run_dir)))
    return path


def kill_after_checkpoint(worker: Path, args: list[str], checkpoint: Path, too_late: Path,
                          env: dict[str, str] | None = None) -> None:
    """Runs ``worker args`` on 2 ranks and SIGKILLs the launcher and every worker (torchrun starts its
    workers in sessions of their own, so killing its process group alone leaves them running) as soon as
    ``checkpoint`` is complete; asserts that it was written and ``too_late`` was not."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(worker), *args]
    job = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 900
    while not is_complete_checkpoint(checkpoint) and job.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    for process in [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]:
        process.send_signal(signal.SIGKILL)
    job.wait()
    assert is_complete_checkpoint(checkpoint), "the run ended before its first checkpoint"
    assert not is_complete_checkpoint(too_late), "killed too late to test a resume"
