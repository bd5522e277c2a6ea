"""GPU check: SFT steps, and GRPO / PPO steps through the real driver with the transformers rollout
engine (no vLLM on the GPU machine), passing the dtype-aware gates."""
import time

import pytest

from _gpu_common import DRY_RUN, ON_GPU, run_config, run_rl, sft_examples


@pytest.mark.gpu
def test_sft_steps_reduce_the_loss(runtime, tiny_llama, report):
    from megarlhf.learner import build_actor, sft_step

    config = run_config(tiny_llama, "bfloat16", "optim.lr=1e-3", "optim.clip_grad=1.0")
    actor = build_actor(config, runtime, total_steps=8)
    examples = sft_examples(actor.vocab_size, (48, 64, 32, 64, 16, 40, 64, 24), prompt_tokens=8, seed=0)
    losses, start = [], time.perf_counter()
    for _ in range(8):
        losses.append(sft_step(actor, examples, config)["sft/loss"])
    seconds = (time.perf_counter() - start) / 8
    report("SFT bf16: loss step 0 -> 7", f"{losses[0]:.3f}->{losses[-1]:.3f}", "", f"{seconds * 1e3:.0f} ms/step")
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("name,overrides", [
    ("GRPO fp32", ["model.dtype=float32", "algorithm.estimator=grpo", "algorithm.kl.coef=0.01"]),
    ("GRPO bf16", ["model.dtype=bfloat16", "algorithm.estimator=grpo", "algorithm.kl.coef=0.01"]),
    ("PPO (GAE) bf16", ["model.dtype=bfloat16", "algorithm.estimator=gae", "algorithm.kl_mode=reward"]),
])
def test_rl_steps_pass_the_gates(tiny_llama, task, tmp_path, name, overrides, report):
    records = run_rl(tiny_llama, task, tmp_path, *overrides)
    steps = [r for r in records if r.get("actor/loss") is not None]
    assert len(steps) == 3
    step0 = steps[0]
    report(f"{name}: step-0 gap max / mean", f"{step0['mismatch/step0_logprob_gap_max']:.2e}/"
           f"{step0['mismatch/step0_logprob_gap_mean']:.2e}", "nats",
           f"{sum(r['time/step_s'] for r in steps[1:]) / 2:.2f} s/step (steps 1-2), HF engine")
    report(f"{name}: sync probe max", step0["weight_sync/probe_max_abs_diff"], "nats")
    if not DRY_RUN:
        assert step0["time/step_s"] > 0


@pytest.mark.gpu
def test_shared_prompt_prefix_gives_the_whole_sequences_log_probs(runtime, tiny_llama, report):
    """Shared-prefix packing (``train.share_prompt_prefix``) on the device: fp32 log-probs equal those of
    the sequences packed whole (to summation order); in bf16 they are no further from the fp32 reference
    than packing whole is."""
    import torch

    from megarlhf.learner import ExperienceBatch, build_actor, compute_logprobs
    from megarlhf.learner.step import micro_batches_for, prefix_sharing_off_reason, tokens_saved_by_sharing

    gen = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for _ in range(8):  # 8 groups of 4 samples
        prompt = torch.randint(0, 384, (48,), generator=gen).tolist()
        for _ in range(4):
            prompts.append(prompt)
            responses.append(torch.randint(0, 384, (int(torch.randint(16, 65, (1,), generator=gen)),),
                                           generator=gen).tolist())
    batch = ExperienceBatch.from_sequences(prompts, responses, device=runtime.device)
    mask = batch.response_mask
    results = {}
    for dtype in ("float32", "bfloat16"):
        config = run_config(tiny_llama, dtype)
        actor = build_actor(config, runtime)
        for share in (True, False):
            config.train.share_prompt_prefix = share
            if share:  # else this would compare whole sequences with whole sequences
                assert prefix_sharing_off_reason(config, runtime) is None, prefix_sharing_off_reason(config, runtime)
                saved = tokens_saved_by_sharing(micro_batches_for(batch.input_ids, batch.lengths, mask, config,
                                                                  runtime))
                assert saved > 0, "shared prefixes were asked for but nothing was shared"
            results[(dtype, share)] = compute_logprobs(actor, batch, config).float()
    reference = results[("float32", False)]
    fp32_gap = float((results[("float32", True)] - reference)[mask].abs().max())
    bf16_err = {share: float((results[("bfloat16", share)] - reference)[mask].abs().mean()) for share in (True, False)}
    report("shared prefix fp32: max |lp - whole|", fp32_gap)
    report("shared prefix bf16: mean |lp - fp32|", bf16_err[True], "", f"whole: {bf16_err[False]:.2e}")
    assert fp32_gap <= 1e-4
    assert bf16_err[True] <= 1.5 * bf16_err[False] + 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,bounds,prefix_of", [
    ("float32", (0, 300, 420, 700, 1000, 1900, 2048), (-1, 0, 0, -1, -1, 4)),
    ("bfloat16", (0, 300, 420, 700, 1000, 1900, 2048), (-1, 0, 0, -1, -1, 4)),
    ("bfloat16", (0, 30, 50, 90, 100), (-1, 0, 0, -1)),  # under 128 tokens: flex's decoding kernel is not used
])
def test_flex_packed_attention_matches_the_per_segment_loop(dtype, bounds, prefix_of, report):
    """One FlexAttention call per packed row against the per-segment SDPA loop: values and gradients, plain
    segments and shared-prefix branches, grouped-query heads."""
    import torch

    from parallel import flex_packed_attention as flex
    from parallel.cp_attention import per_sequence_attention

    if not ON_GPU:
        pytest.skip("FlexAttention's backward runs on CUDA only")
    assert flex.flex_usable(torch.empty(0, device="cuda"), 64)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape, n = dict(dtype=getattr(torch, dtype), device="cuda"), bounds[-1]
    q = torch.randn(1, 4, 4, n, 64, generator=gen, **shape).requires_grad_()
    k = torch.randn(1, 4, 1, n, 64, generator=gen, **shape).requires_grad_()
    v = torch.randn(1, 4, 1, n, 64, generator=gen, **shape).requires_grad_()
    grad = torch.randn(1, 4, 4, n, 64, generator=gen, **shape)
    outs = {}
    for name in ("flex", "loop"):
        out = (flex.flex_packed_attention(q, k, v, flex.segment_block_mask(bounds, prefix_of, q.device), 0.125)
               if name == "flex" else per_sequence_attention(q, k, v, bounds, 0.125, prefix_of))
        outs[name] = (out.float(), *(g.float() for g in torch.autograd.grad((out * grad).sum(), (q, k, v))))
    diffs = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(outs["flex"], outs["loop"])]
    report(f"flex vs loop attention {dtype}, {n} tokens: rel. max |d| out/dq/dk/dv", "/".join(f"{d:.1e}" for d in diffs))
    assert max(diffs) < (1e-5 if dtype == "float32" else 2e-2)


@pytest.mark.gpu
def test_cudas_own_sync_detection_sees_no_more_than_the_host_sync_counter(runtime, tiny_llama, report):
    """An actor's scoring pass and GRPO update in bf16 under ``torch.cuda.set_sync_debug_mode("warn")``:
    every synchronisation CUDA reports must be one the CPU-side counter (megarlhf.records.host_syncs, which
    the CPU tests use to hold the step's count flat) also counts, so a sync the counter cannot see shows
    here as CUDA's count exceeding it."""
    import warnings

    import torch

    from megarlhf.learner import ExperienceBatch, actor_update, build_actor, compute_logprobs
    from megarlhf.records.host_syncs import HostSyncCounter

    if not ON_GPU:
        pytest.skip("CUDA's sync detection needs CUDA")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 384, (24,), generator=gen).tolist() for _ in range(8)]
    responses = [torch.randint(0, 384, (int(torch.randint(8, 40, (1,), generator=gen)),), generator=gen).tolist()
                 for _ in range(8)]
    config = run_config(tiny_llama, "bfloat16", "train.micro_batch_tokens=128")
    actor = build_actor(config, runtime)
    batch = ExperienceBatch.from_sequences(prompts, responses, device=runtime.device, group_ids=list(range(8)))
    batch = batch.replace(rollout_logprobs=torch.zeros_like(batch.response_mask, dtype=torch.float32),
                          advantages=torch.randn(batch.response_mask.shape, generator=gen).to(runtime.device))
    actor_update(actor, batch, config)  # warm-up: lazily built state is not the step's
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught, HostSyncCounter() as counter:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            compute_logprobs(actor, batch, config)
            actor_update(actor, batch, config)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    cuda = [w for w in caught if "synchroniz" in str(w.message).lower()]
    report("host syncs of scoring + update: CUDA vs counter", f"{len(cuda)}/{counter.count}", "",
           "; ".join(sorted({f'{w.filename.rsplit("/", 1)[-1]}:{w.lineno}' for w in cuda}))[:200])
    assert len(cuda) <= counter.count, (len(cuda), dict(counter.where))
