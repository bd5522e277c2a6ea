"""GPU check: SFT steps, and GRPO / PPO steps through the real driver with the transformers rollout
engine (no vLLM on the GPU machine), passing the dtype-aware gates."""
import time

import pytest

from _gpu_common import DRY_RUN, run_config, run_rl


@pytest.mark.gpu
def test_sft_steps_reduce_the_loss(runtime, tiny_llama, report):
    import torch

    from megarlhf.data.sft import SFTExample
    from megarlhf.training import build_actor, sft_step

    config = run_config(tiny_llama, "bfloat16", "optim.lr=1e-3", "optim.clip_grad=1.0")
    actor = build_actor(config, runtime, total_steps=8)
    gen = torch.Generator().manual_seed(0)
    examples = []
    for n in (48, 64, 32, 64, 16, 40, 64, 24):
        ids = torch.randint(0, actor.vocab_size, (n,), generator=gen).tolist()
        examples.append(SFTExample(ids, [0] * 8 + [1] * (n - 8)))
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
