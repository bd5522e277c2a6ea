"""GPU check: the Triton log-prob / entropy kernel against the chunked torch op in bf16 (values,
gradients, peak memory, time) at a realistic size: 8192 tokens, hidden 2048, vocab 32768."""
import pytest
import torch

from _gpu_common import ON_GPU

TOKENS, HIDDEN, VOCAB = 8192, 2048, 32768


def _run(backend: str, hidden, weight, targets):
    from megarlhf.ops import LogprobOptions, logprob_entropy

    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    lp, ent = logprob_entropy(h, w, targets, options=LogprobOptions(backend=backend))
    (lp.sum() + 0.1 * ent.sum()).backward()
    end.record()
    torch.cuda.synchronize()
    return lp.detach(), ent.detach(), h.grad, w.grad, start.elapsed_time(end), torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="Triton kernels need CUDA")
def test_triton_kernel_matches_the_torch_op_in_bf16(report):
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16()
    weight = (0.02 * torch.randn(VOCAB, HIDDEN, device="cuda", generator=gen)).bfloat16()
    targets = torch.randint(0, VOCAB, (TOKENS,), device="cuda", generator=gen)
    for backend in ("torch", "triton"):  # warm-up (Triton compiles)
        _run(backend, hidden, weight, targets)
    t_lp, t_ent, t_gh, t_gw, t_ms, t_mem = _run("torch", hidden, weight, targets)
    k_lp, k_ent, k_gh, k_gw, k_ms, k_mem = _run("triton", hidden, weight, targets)
    lp_diff = float((k_lp - t_lp).abs().max())
    ent_diff = float((k_ent - t_ent).abs().max())
    gh_rel = float((k_gh.float() - t_gh.float()).norm() / t_gh.float().norm())
    gw_rel = float((k_gw.float() - t_gw.float()).norm() / t_gw.float().norm())
    report("Triton vs torch log-probs bf16", lp_diff, "max |d|", f"entropy {ent_diff:.2e}")
    report("Triton vs torch grads bf16", f"{gh_rel:.2e}/{gw_rel:.2e}", "rel (h/w)")
    report("fwd+bwd time torch -> Triton", f"{t_ms:.1f}->{k_ms:.1f}", "ms", f"{TOKENS}x{HIDDEN}, V={VOCAB}")
    report("fwd+bwd peak memory torch -> Triton", f"{t_mem / 2**20:.0f}->{k_mem / 2**20:.0f}", "MiB")
    assert lp_diff < 2e-2 and ent_diff < 5e-2 and gh_rel < 2e-2 and gw_rel < 2e-2
    assert k_mem < 2 * TOKENS * VOCAB * 2  # never a tokens x vocab bf16 logits tensor (plus its gradient)
