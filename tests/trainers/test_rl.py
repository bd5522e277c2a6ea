"""The RL driver end to end: GRPO and PPO (GAE critic) for a few steps on 2 ranks in several layouts.

Checks what a user relies on: every step records the documented metrics; the step-0 gate holds (the
actor's recomputed log-probs equal vLLM's and actor/ppo_kl is 0); the run leaves TensorBoard events,
curves and an HF export that transformers loads.
"""
import json
from pathlib import Path

import pytest

from megarlhf.data.synthetic import write_arithmetic_task
from megarlhf.metrics import read_metrics
from megarlhf.testing.launch import run_torchrun
from model_providers.tiny_models import make_tiny_model

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
ALWAYS = ["reward/mean", "reward/std", "response_len/mean", "actor/pg_loss", "actor/ppo_kl", "actor/entropy",
          "actor/grad_norm", "actor/lr", "mismatch/logprob_abs_diff_max", "time/step_s", "time/rollout_s",
          "time/weight_sync_s", "time/train_s"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    model = make_tiny_model("qwen2", root / "model", seed=0)
    write_arithmetic_task(root / "data", n_train=32, n_heldout=8, seed=0, max_steps=1, instruction=None)
    return model, root / "data"


def _run(tmp_path, assets, estimator, tp, pp):
    model, data = assets
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.replace("MODEL", str(model)).replace("DATA", str(data))
                      .replace("ESTIMATOR", estimator).replace("RUN", str(tmp_path / "run")))
    run_torchrun(WORKER, 2, [str(recipe), f"parallel.tensor_model_parallel_size={tp}",
                             f"parallel.pipeline_model_parallel_size={pp}"], timeout_s=900)
    return tmp_path / "run"


@pytest.mark.parametrize("estimator,tp,pp", [("grpo", 1, 1), ("gae", 1, 1), ("grpo", 2, 1), ("gae", 1, 2)])
def test_rl_run_records_metrics_and_passes_step0_gate(tmp_path, assets, estimator, tp, pp):
    run = _run(tmp_path, assets, estimator, tp, pp)
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]  # two RL steps, then the final evaluation
    for record in records[:2]:
        missing = [k for k in ALWAYS + (["critic/value_loss"] if estimator == "gae" else []) if record.get(k) is None]
        assert not missing, f"step {record['step']} lacks {missing}"
    step0 = records[0]
    assert abs(step0["actor/ppo_kl"]) < 1e-6
    assert step0["mismatch/step_logprob_gap_max"] < 1e-4  # fp32: trainer and vLLM agree at step 0
    assert "eval/accuracy" in step0 and "eval/accuracy" in records[2]
    assert (run / "curves.png").is_file() and any((run / "tensorboard").iterdir())
    assert (run / "config.yaml").is_file()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run / "hf")
