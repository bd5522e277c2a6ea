"""GPU check: HF transformers vs megarlhf's Megatron model on CUDA, fp32 and bf16 (the trainer's
log-prob path: packed micro-batches and the fused log-prob op, Triton on CUDA)."""
import pytest
import torch

from _gpu_common import run_config

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.15}  # bf16: two implementations rounding differently


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_vs_megatron_logprobs(runtime, tiny_llama, dtype, report):
    from transformers import AutoModelForCausalLM

    from megarlhf.core.dtypes import torch_dtype
    from megarlhf.learner import ExperienceBatch, build_frozen, compute_logprobs

    config = run_config(tiny_llama, dtype)
    policy = build_frozen(config, runtime, "policy")
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, policy.vocab_size, (int(n),), generator=gen).tolist() for n in (64, 40, 17, 64)]
    batch = ExperienceBatch.from_sequences([s[:1] for s in sequences], [s[1:] for s in sequences],
                                           device=runtime.device)
    ours = compute_logprobs(policy, batch, config, temperature=1.0)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch_dtype(dtype)).to(runtime.device).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids).logits.float()
    reference = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask = batch.response_mask[:, 1:]
    diff = float((ours[:, 1:] - reference).abs()[mask].max())
    report(f"HF vs Megatron log-probs {dtype}", diff, "max |d|", f"{int(mask.sum())} tokens, tiny Llama")
    assert diff < TOLERANCE[dtype]
