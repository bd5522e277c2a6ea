"""Benchmark: how a LoRA policy reaches vLLM, merged-weight sync vs adapter-only, side by side in one process.

One RL step's rollout cost under each design, on the same model (the tiny demo shape by default,
``--smollm2 DIR`` for SmolLM2-135M-Instruct, ``--qwen05`` for a random Qwen2-0.5B shape), LoRA rank
``--rank`` on every linear layer with random B (a trained adapter):

* merged (what megarlhf does): ``WeightSync.sync`` of the merged weights ``W + s B A`` (verified bit
  for bit, as every sync) into a plain vLLM engine, then generation;
* adapter-only (``rollout.weight_sync.lora=adapter``): ``AdapterSync.sync`` (megarlhf.rollout.sync.adapters:
  the adapters written as a PEFT directory in shared memory and loaded by an ``enable_lora`` vLLM engine,
  its adapter slots verified bit for bit), then generation through vLLM's LoRA kernels.

Both syncs include their probe forward (``rollout.weight_sync.probe_sequences``: 4 x 64 tokens).

Both engines generate the same prompts (``--prompts`` x ``--samples``, ``--tokens`` new tokens, sampled
with ``ignore_eos``, so the token counts are equal). Prints the medians of ``--repeats`` runs and the
ratios: sync, generation and their sum (adapter-only / merged).
Usage:  OMP_NUM_THREADS=2 .venv/bin/python bench/bench_lora_sync.py [--smollm2 DIR | --qwen05] [--rank 16]
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


def _model_dir(args, tmp: Path) -> Path:
    from model_providers.tiny_models import QWEN2_0_5B_SHAPE, make_tiny_model

    if args.smollm2:
        return Path(args.smollm2)
    return make_tiny_model("qwen2", tmp / "src", seed=0, **(QWEN2_0_5B_SHAPE if args.qwen05 else {}))


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", default=None, help="a fetched SmolLM2 directory")
    parser.add_argument("--qwen05", action="store_true", help="a random Qwen2-0.5B-shaped model")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from megarlhf.config.model import ModelConfig
    from megarlhf.config.schema import RunConfig
    from megarlhf.config.data import DataConfig
    from megarlhf.rollout.sync.adapters import AdapterSync, engine_lora
    from megarlhf.rollout.sync.calibration import calibrate_colocated
    from megarlhf.config.rollout import RolloutConfig, WeightSyncConfig
    from megarlhf.rollout.engines.sampling import SamplingConfig
    from megarlhf.rollout.engines import EngineConfig
    from megarlhf.rollout.engines.vllm import VLLMEngine
    from megarlhf.rollout.sync.weights import WeightSync
    from megarlhf.learner import TrainModel
    from model_providers.hf_checkpoint import load_hf_model
    from megarlhf.config.parallel import ParallelConfig
    from megarlhf.config.model import LoRAConfig
    from parallel.lora import adapters_of, attach_lora
    from parallel.runtime import init_parallel

    runtime = init_parallel(ParallelConfig())
    lora = LoRAConfig(rank=args.rank, alpha=2.0 * args.rank)
    with tempfile.TemporaryDirectory() as tmp:
        src = _model_dir(args, Path(tmp))
        config = RunConfig(model=ModelConfig(path=str(src), dtype="float32", lora=lora),
                           data=DataConfig(train_path="unused.jsonl", max_prompt_length=64),
                           rollout=RolloutConfig(max_new_tokens=args.tokens, kv_cache_mb=512,
                                                 weight_sync=WeightSyncConfig(probe_max_length=0, lora="adapter")))
        provider, model = load_hf_model(src, params_dtype=torch.float32, packed_sequences=True)
        attach_lora(model, lora, seed=0)
        actor = TrainModel("actor", model, provider, runtime)
        syncs = {}
        for mode, sync_class in (("merged", WeightSync), ("adapter", AdapterSync)):
            engine_config = EngineConfig.from_rollout(config.rollout, model_dtype="float32", seed=0,
                                                      max_prompt_length=64,
                                                      **(engine_lora(config) if mode == "adapter" else {}))
            syncs[mode] = sync_class(VLLMEngine(str(src), engine_config), actor, config)
            calibrate_colocated(syncs[mode], [], ())  # on the checkpoint, while the adapters are fresh (B = 0)
        with torch.no_grad():
            for adapter in adapters_of(model):
                adapter.B.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(1))
        vocab = provider.hf_config.vocab_size
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (24,), generator=gen).tolist()  # host: bench input
                   for _ in range(args.prompts)]
        sampling = SamplingConfig(n=args.samples, temperature=1.0, max_new_tokens=args.tokens, ignore_eos=True,
                                  seed=0)
        rows = {f"{mode} {what}": [] for mode in syncs for what in ("sync", "generate")}
        for _ in range(args.repeats):
            for mode, sync in syncs.items():
                rows[f"{mode} sync"].append(sync.sync()["time/weight_sync_s"])
                rows[f"{mode} generate"].append(_timed(lambda: sync.engine.generate(prompts, sampling))[0])
    med = {k: statistics.median(v) for k, v in rows.items()}
    name = "SmolLM2-135M" if args.smollm2 else ("Qwen2-0.5B shape" if args.qwen05 else "tiny qwen2")
    print(f"model: {name}, fp32, LoRA rank {args.rank} on every linear layer; {args.prompts} prompts x "
          f"{args.samples} samples x {args.tokens} tokens; torch threads {torch.get_num_threads()}; "
          f"median of {args.repeats}")
    for key, values in rows.items():
        print(f"  {key:20s} {med[key]:8.3f} s   runs {[round(v, 3) for v in values]}")
    merged, adapter = med["merged sync"] + med["merged generate"], med["adapter sync"] + med["adapter generate"]
    print(f"adapter-only / merged: sync {med['adapter sync'] / med['merged sync']:.2f}x   generation "
          f"{med['adapter generate'] / med['merged generate']:.2f}x   sync + generation {adapter / merged:.2f}x")


if __name__ == "__main__":
    main()
