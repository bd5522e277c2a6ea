"""Benchmark: how long a run checkpoint blocks training, synchronous vs ``checkpoint.async_save``, side by side.

One process, the actor of an RL run (weights, Adam state after one update, lr schedule, RNG states) saved
through ``RunCheckpointer`` as the trainers save it, on the model of ``--smollm2 DIR`` (SmolLM2-135M-Instruct)
or by default a random Qwen2 model of the tiny demo's shape. Per repeat, alternating:

* sync: ``save()`` until the checkpoint is published (the whole time blocks training);
* async: ``save()`` until it returns (staging: the time that blocks training), then one training update
  while the background write runs, then ``close()`` (waiting for the write and publishing it);
* the same training update with no write in flight (what the write costs the step it overlaps, on a
  machine whose cores the writer shares).

Prints the medians of ``--repeats`` and the ratios.
Usage:  OMP_NUM_THREADS=2 .venv/bin/python bench/bench_async_save.py [--smollm2 DIR] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _update(actor, config, vocab: int, seed: int) -> None:
    """One actor update on random sequences (GRPO-style advantages of +-1)."""
    from megarlhf.learner import ExperienceBatch, actor_update, compute_logprobs

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (16,), generator=g).tolist() for _ in range(4)]
    responses = [torch.randint(0, vocab, (48,), generator=g).tolist() for _ in range(4)]
    batch = ExperienceBatch.from_sequences(prompts, responses, device=torch.device("cpu"), group_ids=[0, 0, 1, 1])
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0]).unsqueeze(1).expand_as(batch.response_mask).contiguous()
    logprobs = compute_logprobs(actor, batch, config)
    actor_update(actor, batch.replace(advantages=advantages, old_logprobs=logprobs, ref_logprobs=logprobs), config)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", default=None, help="a fetched SmolLM2 directory")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from megarlhf.config.train import CheckpointConfig, LoggingConfig, TrainConfig
    from megarlhf.config.model import ModelConfig
    from megarlhf.config.schema import RunConfig
    from megarlhf.config.data import DataConfig
    from megarlhf.run.checkpointer import RunCheckpointer
    from megarlhf.learner import build_actor
    from model_providers.tiny_models import make_tiny_model
    from megarlhf.config.parallel import ParallelConfig
    from parallel.runtime import init_parallel

    tmp = Path(tempfile.mkdtemp(prefix="bench_async_save_"))
    model_dir = Path(args.smollm2) if args.smollm2 else make_tiny_model("qwen2", tmp / "src", seed=0)
    runtime = init_parallel(ParallelConfig())

    def config(name: str, async_save: bool) -> RunConfig:
        return RunConfig(model=ModelConfig(path=str(model_dir), dtype="float32"),
                         data=DataConfig(train_path="unused.jsonl"),
                         train=TrainConfig(steps=1000, global_batch_size=4, mini_batches=1, micro_batch_tokens=256),
                         checkpoint=CheckpointConfig(dir=str(tmp / name), every=1, keep_last=1, async_save=async_save),
                         logging=LoggingConfig(run_dir=str(tmp / "run")))

    sync_config, async_config = config("sync", False), config("async", True)
    actor = build_actor(sync_config, runtime)
    vocab = actor.provider.hf_config.vocab_size
    _update(actor, sync_config, vocab, seed=0)  # Adam state exists, as in a run's checkpoints
    sync_saver = RunCheckpointer(sync_config, {"actor": actor})
    params = sum(p.numel() for p in actor.model.parameters())
    times = {"sync save": [], "async save (blocking)": [], "async write + publish (waited)": [],
             "update alone": [], "update during write": []}
    for repeat in range(1, args.repeats + 1):
        times["sync save"].append(_timed(lambda: sync_saver.save(repeat, {"step": repeat})))
        times["update alone"].append(_timed(lambda: _update(actor, sync_config, vocab, seed=repeat)))
        async_saver = RunCheckpointer(async_config, {"actor": actor})
        times["async save (blocking)"].append(_timed(lambda: async_saver.save(repeat, {"step": repeat})))
        times["update during write"].append(_timed(lambda: _update(actor, sync_config, vocab, seed=repeat)))
        times["async write + publish (waited)"].append(_timed(async_saver.close))
    median = {name: statistics.median(values) for name, values in times.items()}
    size = sum(f.stat().st_size for f in (tmp / "sync" / f"step_{args.repeats}").rglob("*") if f.is_file())
    print(f"model {model_dir.name}: {params / 1e6:.1f}M parameters, checkpoint {size / 2**20:.0f} MiB "
          f"(weights + Adam state, fp32); medians of {args.repeats}")
    for name, value in median.items():
        print(f"  {name:32s} {value:8.3f} s")
    print(f"  training blocked: async / sync = {median['async save (blocking)'] / median['sync save']:.3f}")
    print(f"  update slowed by the write: during / alone = "
          f"{median['update during write'] / median['update alone']:.2f}")


if __name__ == "__main__":  # Megatron's writer starts a multiprocessing Manager: the guard is required
    main()
