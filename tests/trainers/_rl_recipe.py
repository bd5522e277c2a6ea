"""The tiny RL recipe the driver tests run (2 ranks, a few steps) and the rank script that runs it."""
from pathlib import Path

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
logging: {run_dir: RUN, tensorboard: true}
"""


def write_recipe(path: Path, assets: tuple[Path, Path], estimator: str, run_dir: Path) -> Path:
    model, data = assets
    path.write_text(RECIPE.replace("MODEL", str(model)).replace("DATA", str(data))
                    .replace("ESTIMATOR", estimator).replace("RUN", str(run_dir)))
    return path
