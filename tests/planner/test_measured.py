"""The planner's trainer-phase estimate against memory measured on CPU runs of tiny models.

Four configurations (1 rank fp32 GRPO+KL with the plain optimizer; 2 ranks DP=2 bf16 PPO with a critic
and the distributed optimizer, on a model of half the width; 2 ranks TP=2 fp32 GRPO+KL with the
distributed optimizer; a Qwen3-MoE at EP=2, fp32 GRPO+KL) run the real trainer functions in
_worker_memory.py. Two measurements per rank:

* activations, exactly: the bytes of the distinct storages autograd saves during one actor update
  (parameters excluded), against the planner's ``activations`` term minus its output-head transient
  (which is live memory but never saved for backward);
* the trainer phase, by RSS: peak RSS of the phase minus the RSS left after the same phase ran with a
  negligible model in the same process (the Python/torch/Megatron runtime is not model memory), against
  the planner's ``train`` phase (actor + reference + critic state + activations; no engine: the worker
  builds none, and on a GPU the engine sleeps during this phase). Must agree within 25%.

The vLLM terms are not measured here: the KV cache is allocated at exactly ``rollout.kv_cache_mb`` and
the engine weights are the checkpoint's bytes, while vLLM's CPU runtime (~1.7 GB RSS) dwarfs a tiny model.
"""
from pathlib import Path

import pytest

from megarlhf.config import RunConfig, load_config
from megarlhf.planner import Launch, plan_memory, resolve_shape
from megarlhf.planner.memory import LOGPROB_CHUNK
from megarlhf.testing.launch import read_rank_results, run_torchrun
from model_providers.tiny_models import make_tiny_model

WORKER = Path(__file__).with_name("_worker_memory.py")
RECIPE = """
model: {path: MODEL, dtype: DTYPE}
data: {train_path: unused.jsonl, max_prompt_length: 64}
rollout: {n_samples: 4, max_new_tokens: 128}
algorithm: {estimator: ESTIMATOR, kl_mode: KL_MODE, kl: {coef: 0.01}}
optim: {use_distributed_optimizer: DIST}
train: {global_batch_size: 4, micro_batch_tokens: 2048}
seed: 0
"""
CONFIGS = {  # name: (ranks, overrides of RECIPE's placeholders, parallel overrides)
    "1rank-fp32-grpo-kl-plainopt": (1, dict(DTYPE="float32", ESTIMATOR="grpo", KL_MODE="loss", DIST="false"), []),
    "dp2-bf16-ppo-critic-distopt": (2, dict(DTYPE="bfloat16", ESTIMATOR="gae", KL_MODE="none", DIST="true"), []),
    "tp2-fp32-grpo-kl-distopt": (2, dict(DTYPE="float32", ESTIMATOR="grpo", KL_MODE="loss", DIST="true"),
                                 ["parallel.tensor_model_parallel_size=2"]),
    # a mixture-of-experts model (Qwen3-MoE, 8 experts, top-2) with its experts split over 2 ranks
    "ep2-fp32-moe-grpo-kl-distopt": (2, dict(DTYPE="float32", ESTIMATOR="grpo", KL_MODE="loss", DIST="true"),
                                     ["parallel.expert_model_parallel_size=2"]),
}
TINY = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=False)
# bf16 GEMMs without AVX512-BF16/AMX (this project's CPU machines) run ~12x slower than fp32: the bf16 case
# measures a model of half the width (about a quarter of the FLOPs), still large next to the runtime's noise
TINY_BF16 = dict(TINY, hidden_size=256, intermediate_size=768, num_attention_heads=4)
TINY_MOE = dict(TINY, head_dim=64, moe_intermediate_size=384, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("planner-models")
    base = make_tiny_model("qwen2", root / "base", seed=0, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, vocab_size=512)
    base_moe = make_tiny_model("qwen3_moe", root / "base_moe", seed=0, hidden_size=64, moe_intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, vocab_size=512,
                               mlp_only_layers=[])
    return {"base": base, "model": make_tiny_model("qwen2", root / "model", seed=0, **TINY),
            "bf16_model": make_tiny_model("qwen2", root / "bf16_model", seed=0, **TINY_BF16),
            "base_moe": base_moe, "moe": make_tiny_model("qwen3_moe", root / "moe", seed=0, **TINY_MOE)}


def _recipe(path: Path, model: Path, values: dict) -> Path:
    text = RECIPE.replace("MODEL", str(model))
    for key, value in values.items():
        text = text.replace(key, value)
    path.write_text(text)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_planner_matches_measured_memory(tmp_path, models, name):
    ranks, values, overrides = CONFIGS[name]
    moe = "moe" in name
    base = _recipe(tmp_path / "base.yaml", models["base_moe" if moe else "base"], values)
    model = "moe" if moe else "bf16_model" if values["DTYPE"] == "bfloat16" else "model"
    recipe = _recipe(tmp_path / "recipe.yaml", models[model], values)
    run_torchrun(WORKER, ranks, [str(tmp_path / "out"), str(base), str(recipe), *overrides], timeout_s=600,
                 env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    measured = read_rank_results(tmp_path / "out", ranks)
    config = load_config(RunConfig, recipe, overrides)
    shape, _ = resolve_shape(config.model.path)
    stage = plan_memory(config, shape, Launch(world_size=ranks, device="gpu")).stages[0]
    tp = config.parallel.tensor_model_parallel_size
    tokens = config.train.micro_batch_tokens
    head_transient = tokens * 3 * min(LOGPROB_CHUNK, shape.padded_vocab(tp) // tp) * 4
    predicted_saved = stage.components["activations"] - head_transient
    for rank, result in enumerate(measured):
        saved_err = predicted_saved / result["saved_activation_bytes"] - 1
        rss_err = stage.phases["train"] / result["model_peak_bytes"] - 1
        print(f"\n{name} rank {rank}: saved activations measured {result['saved_activation_bytes'] / 2**20:.1f} MiB, "
              f"planned {predicted_saved / 2**20:.1f} MiB ({100 * saved_err:+.1f}%); trainer phase measured "
              f"{result['model_peak_bytes'] / 2**20:.1f} MiB (peak RSS {result['peak_kib'] / 1024:.0f} MiB - "
              f"baseline {result['baseline_kib'] / 1024:.0f} MiB), planned {stage.phases['train'] / 2**20:.1f} MiB "
              f"({100 * rss_err:+.1f}%)")
        assert abs(saved_err) < 0.05, f"{name} rank {rank}: saved activations off by {100 * saved_err:+.1f}%"
        assert abs(rss_err) < 0.25, f"{name} rank {rank}: trainer-phase memory off by {100 * rss_err:+.1f}%"
