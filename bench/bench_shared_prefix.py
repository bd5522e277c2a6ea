"""Shared prompt prefixes in the trainer: one GRPO-shaped batch scored and trained with the groups' prompt
held once per micro-batch (``train.share_prompt_prefix=true``) and with every sample packed whole.

Both variants run in the same process on the same batch, alternating: a scoring forward (``compute_logprobs``) and one actor update (forward,
backward, optimizer step). Reports the median wall time of each, the ratios, the tokens the model
computes, and the largest log-prob difference between the two (fp32 summation order only).

    .venv/bin/torchrun --nproc-per-node 1 bench/bench_shared_prefix.py --model-dir DIR \\
        [--prompts 16] [--samples 8] [--prompt-length 58] [--response-length 30:96] [--repeats 3]

Without ``--model-dir`` a tiny random Llama is built (for a quick look; the shapes then say little).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def grpo_batch(args, vocab: int):
    """``prompts`` x ``samples`` sequences: one random prompt per group, random responses of random length."""
    from megarlhf.learner import ExperienceBatch

    g = torch.Generator().manual_seed(0)
    low, high = (int(x) for x in args.response_length.split(":"))
    prompts, responses = [], []
    for _ in range(args.prompts):
        prompt = torch.randint(0, vocab, (args.prompt_length,), generator=g).tolist()
        for _ in range(args.samples):
            n = int(torch.randint(low, high + 1, (1,), generator=g))
            prompts.append(prompt)
            responses.append(torch.randint(0, vocab, (n,), generator=g).tolist())
    batch = ExperienceBatch.from_sequences(prompts, responses, device=torch.device("cpu"),
                                           group_ids=[i // args.samples for i in range(len(prompts))])
    advantages = torch.randn(batch.input_ids.shape, generator=g) * batch.response_mask
    return batch.replace(advantages=advantages, returns=advantages.clone())


def run_config(model_dir: str, micro_batch_tokens: int):
    from megarlhf.config.model import ModelConfig
    from megarlhf.config.train import OptimConfig, TrainConfig
    from megarlhf.config.schema import RunConfig
    from megarlhf.config.data import DataConfig

    config = RunConfig(model=ModelConfig(path=model_dir, dtype="float32"), data=DataConfig(train_path="unused.jsonl"),
                       optim=OptimConfig(lr=1e-6, clip_grad=1.0),
                       train=TrainConfig(micro_batch_tokens=micro_batch_tokens))
    config.algorithm.kl.coef = 0.0
    return config


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=58)
    parser.add_argument("--response-length", default="30:96", help="LOW:HIGH, uniform")
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from megarlhf.learner import actor_update, build_actor, compute_logprobs
    from megarlhf.learner.step import micro_batches_for
    from megarlhf.config.parallel import ParallelConfig
    from parallel.runtime import init_parallel

    runtime = init_parallel(ParallelConfig())
    model_dir = args.model_dir
    if model_dir is None:
        from model_providers.tiny_models import make_tiny_model

        model_dir = str(Path(tempfile.mkdtemp()) / "llama")
        make_tiny_model("llama", model_dir, seed=0)
    config = run_config(model_dir, args.micro_batch_tokens)
    actor = build_actor(config, runtime)
    batch = grpo_batch(args, actor.vocab_size)
    times = {(share, part): [] for share in (True, False) for part in ("score", "update")}
    logprobs, tokens = {}, {}
    for _ in range(args.repeats):
        for share in (True, False):
            config.train.share_prompt_prefix = share
            tokens[share] = sum(mb.num_tokens for mb in micro_batches_for(
                batch.input_ids, batch.lengths, batch.response_mask, config, runtime))
            seconds, scored = timed(lambda: compute_logprobs(actor, batch, config))
            logprobs.setdefault(share, scored)  # both from the starting weights (before any update)
            times[(share, "score")].append(seconds)
        for share in (True, False):  # the updates move the weights a little (lr 1e-6): timing only
            config.train.share_prompt_prefix = share
            seconds, _ = timed(lambda: actor_update(actor, batch.replace(old_logprobs=logprobs[share]), config))
            times[(share, "update")].append(seconds)
    med = {key: statistics.median(values) for key, values in times.items()}
    mask = batch.response_mask
    print(f"{args.prompts} prompts x {args.samples} samples, prompt {args.prompt_length} tokens, responses "
          f"{args.response_length} (mean {float((batch.lengths - args.prompt_length).float().mean()):.1f}); "
          f"budget {args.micro_batch_tokens}; median of {args.repeats}")
    print(f"tokens computed: shared {tokens[True]}, whole {tokens[False]} ({tokens[True] / tokens[False]:.3f})")
    for part in ("score", "update"):
        print(f"{part:7s} shared {med[(True, part)]:8.2f} s   whole {med[(False, part)]:8.2f} s   "
              f"shared/whole = {med[(True, part)] / med[(False, part)]:.3f}")
    print(f"max |log-prob difference| on response tokens: {float((logprobs[True] - logprobs[False])[mask].abs().max()):.2e}")


if __name__ == "__main__":
    main()
