"""GPU check: the planner's trainer-phase estimate against ``torch.cuda.max_memory_allocated``, and the
achieved train-step TFLOP/s and MFU against the GPU's dense bf16 peak, on a ~250M-parameter Llama shape
(hidden 1024, 12 layers, GQA 16/4, vocab 32000), bf16, distributed optimizer, 8192-token micro-batches."""
import time

import pytest
import torch

from _gpu_common import DRY_RUN, ON_GPU, run_config

SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)
SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=False)
BF16_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s (SXM)
SEQ, SEQUENCES = 1024, 8  # one 8192-token packed micro-batch


def _peak_flops() -> float | None:
    name = torch.cuda.get_device_name(0) if ON_GPU else ""
    return next((peak for key, peak in BF16_PEAK.items() if key in name), None)


def _train_flops(shape: dict, tokens: int, seq: int) -> float:
    """Model FLOPs of one forward + backward (6 per parameter per token) plus causal attention scores."""
    h, layers, ffn, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"], shape["vocab_size"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * ffn  # q, o, k, v projections and the SwiGLU MLP
    dense = 6 * tokens * (layers * per_layer + h * vocab)
    attention = 6 * layers * tokens * seq * h  # QK^T and PV, causal half, forward + backward
    return dense + attention


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory):
    from model_providers.tiny_models import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("gpu_mid") / "llama", seed=0,
                           **(SMALL if DRY_RUN else SHAPE))


@pytest.mark.gpu
def test_planner_and_mfu(runtime, mid_model, report):
    from megarlhf.planner import Launch, plan_memory, resolve_shape
    from megarlhf.learner import ExperienceBatch, actor_update, build_actor

    shape_dict = SMALL if DRY_RUN else SHAPE
    config = run_config(mid_model, "bfloat16", f"train.micro_batch_tokens={SEQ * SEQUENCES}",
                        "data.max_prompt_length=512", "rollout.max_new_tokens=512", "optim.clip_grad=1.0")
    if ON_GPU:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    actor = build_actor(config, runtime)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape_dict["vocab_size"], (SEQUENCES, SEQ), generator=gen).tolist()
    batch = ExperienceBatch.from_sequences([s[:64] for s in ids], [s[64:] for s in ids], device=runtime.device)
    shape = batch.input_ids.shape
    batch = batch.replace(old_logprobs=torch.full(shape, -10.0, device=runtime.device),
                          advantages=torch.randn(shape, generator=gen).to(runtime.device))
    actor_update(actor, batch, config)  # warm-up; Adam state allocated
    steps, start = 3, time.perf_counter()
    for _ in range(steps):
        actor_update(actor, batch, config)
    if ON_GPU:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    flops = _train_flops(shape_dict, SEQ * SEQUENCES, SEQ)
    peak = _peak_flops()
    mfu = f"MFU {100 * flops / seconds / peak:.1f}% of {peak / 1e12:.0f}" if peak else "peak unknown"
    params = sum(p.numel() for p in actor.model.parameters())
    report("train step (actor update) TFLOP/s", flops / seconds / 1e12, "TFLOP/s",
           f"{mfu}; {seconds * 1e3:.0f} ms for {SEQ * SEQUENCES} tokens, {params / 1e6:.0f}M-param Llama bf16")
    plan_shape, _ = resolve_shape(config.model.path)
    plan = plan_memory(config, plan_shape, Launch(world_size=1)).stages[0]
    planned = plan.phases["train"]
    if ON_GPU:
        measured = torch.cuda.max_memory_allocated() - base
        report("planner train phase / measured", planned / measured, "ratio",
               f"planned {planned / 2**30:.2f} GiB, max_memory_allocated {measured / 2**30:.2f} GiB")
        assert 0.6 < planned / measured < 1.6


def _grpo_batch(runtime, vocab: int, groups: int, samples: int, prompt_len: int, response_lens: tuple[int, int]):
    """``groups`` prompts x ``samples`` responses of random length, with advantages and old log-probs."""
    from megarlhf.learner import ExperienceBatch

    gen = torch.Generator().manual_seed(1)
    prompts, responses = [], []
    for _ in range(groups):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        for _ in range(samples):
            n = int(torch.randint(response_lens[0], response_lens[1] + 1, (1,), generator=gen))
            prompts.append(prompt)
            responses.append(torch.randint(0, vocab, (n,), generator=gen).tolist())
    batch = ExperienceBatch.from_sequences(prompts, responses, device=runtime.device,
                                           group_ids=[i // samples for i in range(len(prompts))])
    shape = batch.input_ids.shape
    return batch.replace(old_logprobs=torch.full(shape, -10.0, device=runtime.device),
                         advantages=torch.randn(shape, generator=gen).to(runtime.device) * batch.response_mask)


def _timed_update(actor, batch, config, runtime, share: bool):
    """(seconds, peak bytes above the state before it, tokens sharing saved) of one actor update."""
    from megarlhf.learner import actor_update
    from megarlhf.learner.step import micro_batches_for, tokens_saved_by_sharing

    config.train.share_prompt_prefix = share
    saved = tokens_saved_by_sharing(micro_batches_for(batch.input_ids, batch.lengths, batch.response_mask,
                                                      config, runtime))
    if ON_GPU:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    actor_update(actor, batch, config)
    if ON_GPU:
        torch.cuda.synchronize()
    return time.perf_counter() - start, (torch.cuda.max_memory_allocated() - base) if ON_GPU else 0, saved


@pytest.mark.gpu
def test_shared_prefix_update_memory_and_time(runtime, mid_model, report, monkeypatch):
    """One actor update (forward, backward, optimizer step) of a GRPO batch packed whole and with the groups'
    prompts shared, the latter with one FlexAttention call per micro-batch (the GPU default) and with the
    per-segment SDPA loop: peak device memory above the model's state, and wall time (best of 2), bf16."""
    from megarlhf.learner import actor_update, build_actor
    from parallel import cp_attention

    shape_dict = SMALL if DRY_RUN else SHAPE
    config = run_config(mid_model, "bfloat16", f"train.micro_batch_tokens={SEQ * SEQUENCES}",
                        "data.max_prompt_length=512", "rollout.max_new_tokens=512", "optim.clip_grad=1.0")
    actor = build_actor(config, runtime)
    batch = _grpo_batch(runtime, shape_dict["vocab_size"], *((2, 4, 32, (8, 32)) if DRY_RUN else (16, 8, 512, (64, 512))))
    flex_usable = cp_attention.flex_usable
    variants = {"whole": (False, flex_usable), "shared, per-segment loop": (True, lambda *a: False),
                "shared, FlexAttention": (True, flex_usable)}
    results = {}
    for name, (share, usable) in variants.items():
        monkeypatch.setattr(cp_attention, "flex_usable", usable)
        config.train.share_prompt_prefix = share
        actor_update(actor, batch, config)  # warm-up (Adam state, compilation)
        results[name] = min((_timed_update(actor, batch, config, runtime, share) for _ in range(2)),
                            key=lambda r: r[0])
    whole = results["whole"]
    for name, (seconds, peak, saved) in results.items():
        report(f"update {name}: time / whole", seconds / whole[0], "ratio",
               f"{seconds * 1e3:.0f} ms; {saved} of {int(batch.lengths.sum())} tokens saved")
        if ON_GPU:
            report(f"update {name}: peak memory", peak / 2**20, "MiB", "above the model's state")
    assert results["shared, FlexAttention"][2] > 0
