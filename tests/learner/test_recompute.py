"""Activation recomputation (``train.recompute``, Megatron's full recomputation) on the trainer's actor:
the update's loss, metrics and resulting parameters are identical with and without it, the memory saved
for backward falls, and the planner predicts it (uniform chunks of 1 and 2 layers, block of 1 layer)."""
from pathlib import Path

import pytest

from megarlhf.config import RunConfig, load_config
from megarlhf.planner import Launch, plan_memory, resolve_shape
from megarlhf.planner.memory import LOGPROB_CHUNK
from megarlhf.testing.launch import read_rank_results, run_torchrun
from model_providers.tiny_models import make_tiny_model

WORKER = Path(__file__).with_name("_worker_recompute.py")
RECIPE = """
model: {path: MODEL, dtype: float32}
data: {train_path: unused.jsonl, max_prompt_length: 64}
rollout: {n_samples: 4, max_new_tokens: 192}
algorithm: {kl_mode: none}
optim: {lr: 1.0e-3, clip_grad: 0.0}
train: {global_batch_size: 4, micro_batch_tokens: 256}
"""
SETTINGS = {"none": [], "uniform1": ["train.recompute.granularity=full"],
            "uniform2": ["train.recompute.granularity=full", "train.recompute.num_layers=2"],
            "block1": ["train.recompute.granularity=full", "train.recompute.method=block"]}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    root = tmp_path_factory.mktemp("recompute")
    model = make_tiny_model("qwen2", root / "model", seed=0, hidden_size=256, intermediate_size=768,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024)
    recipe = root / "recipe.yaml"
    recipe.write_text(RECIPE.replace("MODEL", str(model)))
    run_torchrun(WORKER, 1, [str(recipe), str(root / "out")], timeout_s=600)
    return recipe, read_rank_results(root / "out", 1)[0]


def test_recomputation_changes_no_number(measured):
    _, runs = measured
    base = runs["none"]["metrics"]
    for name in ("uniform1", "uniform2", "block1"):
        assert runs[name]["granularity"] == "full"
        assert runs[name]["metrics"] == base, name  # loss, grad norm, every metric: bit for bit
        assert runs[name]["param_max_diff"] == 0.0, name
    assert runs["none"]["granularity"] is None


def test_activation_memory_falls_as_the_planner_predicts(measured):
    recipe, runs = measured
    planned = {}
    for name, overrides in SETTINGS.items():
        config = load_config(RunConfig, recipe, overrides)
        shape, _ = resolve_shape(config.model.path)
        stage = plan_memory(config, shape, Launch(world_size=1)).stages[0]
        head_transient = config.train.micro_batch_tokens * 3 * min(LOGPROB_CHUNK, shape.padded_vocab(1)) * 4
        planned[name] = stage.components["activations"] - head_transient  # never saved for backward
    for name in SETTINGS:
        measured_bytes = runs[name]["peak_saved_bytes"]
        print(f"{name}: peak saved {measured_bytes / 2**20:.2f} MiB, planned {planned[name] / 2**20:.2f} MiB")
        assert abs(planned[name] / measured_bytes - 1) < 0.10, name
    assert runs["uniform1"]["peak_saved_bytes"] < 0.5 * runs["none"]["peak_saved_bytes"]
    assert runs["uniform1"]["peak_saved_bytes"] < runs["uniform2"]["peak_saved_bytes"] < runs["none"]["peak_saved_bytes"]
    assert runs["uniform1"]["peak_saved_bytes"] < runs["block1"]["peak_saved_bytes"] < runs["none"]["peak_saved_bytes"]
