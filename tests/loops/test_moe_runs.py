"""GRPO on a tiny mixture-of-experts model (Qwen3-MoE: a dense first layer, 8 experts, top-2) through the
command line at EP2 on 2 ranks with the HF rollout backend (and vLLM's, slow): the step-0 gate and the bit-verified weight
sync pass with the engine's fused experts, the routing metrics are logged, the reward rises, the export
loads in transformers; a killed and resumed run is bit-identical (slow). The HF-backend runs replay the
engine's routing (R3: the engine records it, the trainer routes every recorded token as the engine did);
vLLM records routing only on a GPU."""
from pathlib import Path

import pytest
import torch

import megarlhf
from megarlhf.data.synthetic import write_arithmetic_task
from megarlhf.records.metrics import read_metrics
from megarlhf.testing.launch import run_torchrun
from model_providers.tiny_models import make_tiny_model

from _rl_recipe import kill_after_checkpoint, write_recipe

CLI = Path(megarlhf.__file__).with_name("__main__.py")
REWARDS = {"PYTHONPATH": str(Path(__file__).parent)}  # the test reward module '_rewards'
MOE = ["parallel.expert_model_parallel_size=2", "reward.functions=[{name: '_rewards:digit_fraction'}]",
       "optim.lr=1.0e-2", "eval.every=0", "train.global_batch_size=8"]
TIMING = ("time/", "weight_sync/bytes_per_s", "memory/")  # measured, not computed


@pytest.fixture(scope="module")
def moe_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_rl")
    model = make_tiny_model("qwen3_moe", root / "model", seed=0)
    write_arithmetic_task(root / "data", n_train=64, n_heldout=8, seed=0, max_steps=1, instruction=None)
    return model, root / "data"


@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_grpo_on_moe_at_ep2(moe_assets, tmp_path, backend):
    recipe = write_recipe(tmp_path / "grpo.yaml", moe_assets, "grpo", tmp_path / "run")
    replay = ["algorithm.routing_replay=r3"] if backend == "hf" else []
    run_torchrun(CLI, 2, ["train", str(recipe), *MOE, "train.steps=8", f"rollout.backend={backend}", *replay],
                 timeout_s=900, env=REWARDS)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(8))
    first = records[0]
    assert first["gates/calibration_checkpoint_bitwise"] == 1.0
    assert first["mismatch/step0_logprob_gap_max"] < 1e-5  # engine and trainer agree at the fp32 floor
    # step 0 sent nothing (the engine held its own load, checked bit for bit); every later step sent its update,
    # verified by the probe
    assert [r["weight_sync/skipped"] for r in records] == [1.0] + [0.0] * 7
    assert all(r["weight_sync/probe_max_abs_diff"] < 1e-4 for r in records[1:])
    assert all(1.0 <= r["actor/moe/imbalance"] <= 4.0 for r in records)  # 8 experts, top-2: at most 8 / 2
    assert {"actor/moe/layer1/imbalance", "actor/moe/layer2/imbalance"} <= set(first)
    assert "actor/moe/layer0/imbalance" not in first  # the dense first layer has no router
    if backend == "hf":  # replayed: the routing used is the engine's in scoring and in every update
        assert first["routing/mismatch_replayed"] == 0.0 and 0.0 <= first["routing/mismatch"] < 0.5
        assert all(r["actor/moe/routing_mismatch_replayed"] == 0.0 for r in records)
    rewards = [r["reward/mean"] for r in records]
    assert sum(rewards[-2:]) / 2 > 2 * sum(rewards[:2]) / 2, rewards
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(moe_assets[0], dtype=torch.float32)
    moved = [n for n, p in exported.state_dict().items() if not torch.equal(p, original.state_dict()[n])]
    assert any("experts" in n for n in moved) and any("mlp.gate" in n for n in moved)


@pytest.mark.slow  # three 2-rank runs (~2 min on 2 cores): make test-slow
def test_moe_run_killed_and_resumed_matches_uninterrupted(moe_assets, tmp_path):
    overrides = [*MOE, "rollout.backend=hf", "train.steps=4", "checkpoint.every=2", "algorithm.routing_replay=r3"]
    full = tmp_path / "full"
    run_torchrun(CLI, 2, ["train", str(write_recipe(tmp_path / "full.yaml", moe_assets, "grpo", full)), *overrides],
                 timeout_s=900, env=REWARDS)
    cut = tmp_path / "cut"
    recipe = write_recipe(tmp_path / "cut.yaml", moe_assets, "grpo", cut)
    kill_after_checkpoint(CLI, ["train", str(recipe), *overrides], cut / "checkpoints" / "step_2",
                          cut / "checkpoints" / "step_4", env=REWARDS)
    run_torchrun(CLI, 2, ["train", str(recipe), *overrides, "checkpoint.resume=auto"], timeout_s=900, env=REWARDS)
    strip = lambda records: [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]  # noqa: E731
    resumed, uninterrupted = read_metrics(cut / "metrics.jsonl"), read_metrics(full / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert strip(resumed) == strip(uninterrupted)
    # another expert-parallel size: the optimizer state cannot follow (refused by name, nothing written), the
    # weights can (a one-process conversion at EP1 equals the run's own export at EP2)
    recipe = write_recipe(tmp_path / "ep1.yaml", moe_assets, "grpo", full)
    at_ep1 = [o for o in overrides if not o.startswith("parallel.expert")] + ["train.steps=6", "checkpoint.resume=auto"]
    before = sorted(p.name for p in (full / "checkpoints").iterdir())
    with pytest.raises(RuntimeError, match=r"saved at expert_model_parallel_size=2, this run has 1"):
        run_torchrun(CLI, 2, ["train", str(recipe), *at_ep1], timeout_s=900, env=REWARDS)
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == before
    converted = tmp_path / "converted"
    run_torchrun(CLI, 1, ["convert", "megatron-to-hf", "--ckpt", str(full / "checkpoints" / "step_4"), "--out",
                          str(converted), "--hf-config", str(moe_assets[0])], timeout_s=600)
    from safetensors.torch import load_file

    ours, theirs = load_file(converted / "model.safetensors"), load_file(full / "hf" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
