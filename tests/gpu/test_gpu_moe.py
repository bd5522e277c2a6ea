"""GPU check: mixture-of-experts models on CUDA (one GPU: expert parallelism 1; the all-to-all dispatcher
still runs, over a one-rank NCCL group). Log-probs vs HF for the three MoE families in fp32 and bf16 (the
router in fp32), a bf16 SFT step with the router losses on, GRPO steps of a tiny Qwen3-MoE through the
real driver with the transformers engine (its fused expert parameters bit-verified after every sync), and
routing replay (R3) of the engine's recorded routing on near-tied routers. vLLM, whose routed-experts capture
needs a GPU, is not on the GPU machine: R3 through vLLM is unchecked there.
Grouped GEMM and Transformer Engine's MoE kernels are not on the GPU machine: Megatron's SequentialMLP
runs the experts."""
import pytest
import torch

from _gpu_common import run_config, run_rl, sft_examples

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.15}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    from model_providers.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("gpu_moe")
    return {arch: make_tiny_model(arch, root / arch, seed=i) for i, arch in enumerate(("qwen3_moe", "qwen2_moe",
                                                                                          "mixtral"))}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_logprobs_match_hf(runtime, moe_models, arch, dtype, report):
    from transformers import AutoModelForCausalLM

    from megarlhf.core.dtypes import torch_dtype
    from megarlhf.learner import ExperienceBatch, build_frozen, compute_logprobs

    config = run_config(moe_models[arch], dtype)
    policy = build_frozen(config, runtime, "policy")
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, policy.vocab_size, (int(n),), generator=gen).tolist() for n in (64, 40, 17)]
    batch = ExperienceBatch.from_sequences([s[:1] for s in sequences], [s[1:] for s in sequences],
                                           device=runtime.device)
    ours = compute_logprobs(policy, batch, config, temperature=1.0)
    hf = AutoModelForCausalLM.from_pretrained(moe_models[arch], dtype=torch_dtype(dtype)).to(runtime.device).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids).logits.float()
    reference = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask = batch.response_mask[:, 1:]
    diff = float((ours[:, 1:] - reference).abs()[mask].max())
    report(f"MoE {arch} HF vs Megatron log-probs {dtype}", diff, "max |d|", f"{int(mask.sum())} tokens")
    assert diff < TOLERANCE[dtype]


@pytest.mark.gpu
def test_moe_bf16_sft_step_with_router_losses(runtime, moe_models, report):
    from megarlhf.learner import build_actor, sft_step

    config = run_config(moe_models["qwen2_moe"], "bfloat16", "model.moe.aux_loss_coeff=0.01",
                        "model.moe.z_loss_coeff=0.001", "optim.lr=1e-3", "optim.warmup_steps=0")
    actor = build_actor(config, runtime)
    examples = sft_examples(384, (40, 33, 60), prompt_tokens=4, seed=1)
    first, second = sft_step(actor, examples, config), sft_step(actor, examples, config)
    report("MoE bf16 SFT loss step 1 -> 2", f"{first['sft/loss']:.4f}->{second['sft/loss']:.4f}", "nats",
           f"imbalance {first['sft/moe/imbalance']:.3f}, lb loss {first['sft/moe/load_balancing_loss']:.3f}")
    assert second["sft/loss"] < first["sft/loss"]
    assert first["sft/moe/load_balancing_loss"] >= 1.0 and first["sft/moe/z_loss"] > 0


@pytest.mark.gpu
def test_moe_grpo_steps_with_verified_sync(moe_models, task, tmp_path, report):
    records = run_rl(moe_models["qwen3_moe"], task, tmp_path, "algorithm.estimator=grpo")
    report("MoE GRPO step-0 logprob gap (HF engine)", records[0]["mismatch/step0_logprob_gap_max"], "max |d|",
           f"{len(records)} steps, probe after every sync")
    assert records[0]["gates/calibration_checkpoint_bitwise"] == 1.0
    assert all("actor/moe/imbalance" in r for r in records if "actor/loss" in r)


@pytest.mark.gpu
def test_moe_routing_replay_r3_closes_the_gap(moe_models, runtime, tmp_path, report):
    """R3 on the device: a Qwen3-MoE whose routers are near-tied (every expert's row one shared row plus 1e-6 x
    its own) flips top-k choices between the HF engine and Megatron; replaying the engine's recorded routing
    brings the trainer's log-probs of the engine's samples back to the fp32 floor."""
    from safetensors.torch import load_file, save_file

    from megarlhf.rollout.engines.sampling import SamplingConfig
    from megarlhf.rollout.engines.hf import HFEngine
    from megarlhf.learner import ExperienceBatch, build_actor, build_frozen, compute_logprobs, old_policy_logprobs
    from megarlhf.learner.routing_replay import moe_layer_indices
    from model_providers.tiny_models import make_tiny_model

    model = make_tiny_model("qwen3_moe", tmp_path / "tied", seed=3)
    weights, gen = load_file(model / "model.safetensors"), torch.Generator().manual_seed(0)
    for name in [n for n in weights if n.endswith("mlp.gate.weight")]:
        weights[name] = torch.randn(weights[name].shape[1], generator=gen)[None] + 1e-6 * torch.randn(
            weights[name].shape, generator=gen)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    config = run_config(model, "float32", "algorithm.routing_replay=r3", "rollout.temperature=1.0")
    actor, plain = build_actor(config, runtime), build_frozen(config, runtime, "policy")
    engine = HFEngine(str(model), dtype=torch.float32, device=runtime.device, seed=0, max_model_len=96,
                             routing_layers=moe_layer_indices(actor.provider))
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 7, 3, 9)]
    rollout = engine.generate(prompts, SamplingConfig(n=4, temperature=1.0, max_new_tokens=32, seed=1,
                                                      ignore_eos=True))
    batch = ExperienceBatch.from_sequences(rollout.prompt_ids, rollout.response_ids, device=runtime.device,
                                           rollout_logprobs=rollout.logprobs, routed_experts=rollout.routed_experts)
    scored, metrics = old_policy_logprobs(actor, batch, config)
    mask = batch.response_mask
    replayed = float((scored.old_logprobs - batch.rollout_logprobs).abs()[mask].max())
    free = float((compute_logprobs(plain, batch, config) - batch.rollout_logprobs).abs()[mask].max())
    report("MoE R3 step-0 logprob gap, free -> replayed", f"{free:.3g}->{replayed:.3g}", "max |d|",
           f"routing mismatch {metrics['routing/mismatch']:.3f} (replayed {metrics['routing/mismatch_replayed']})")
    assert metrics["routing/mismatch_replayed"] == 0.0 and replayed <= free and replayed < 1e-4
