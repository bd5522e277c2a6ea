"""Benchmark: Megatron -> vLLM weight sync, megarlhf's verified in-memory sync vs an unverified in-memory
load of the same tensors and vs the naive disk path, side by side in one process.

Builds a Qwen2-0.5B-shaped random model (hidden 896, 24 layers, 14 heads / 2 KV heads, ffn 4864, vocab
151,936, tied embeddings; fp32 by default), loads it into Megatron (TP=1, one process) and into an
in-process vLLM engine, then times, interleaved, several times each:

* verified: ``WeightSync.sync`` — ``iter_hf_weights`` -> size-bounded buckets -> the worker's
  ``reload_weights(weights_iterator=...)`` -> prefix-cache reset, INCLUDING the bitwise verification
  (the trainer's fingerprints of what it sends, the engine's of its parameters, their comparison; the
  probe forward is timed separately and left out of the ratios);
* unverified: the same tensors straight into ``reload_weights`` -> prefix-cache reset, nothing checked;
* naive: ``export_hf_checkpoint`` (HF safetensors on disk) -> ``reload_weights(weights_path=dir)`` ->
  prefix-cache reset (no verification at all).

Prints seconds, bytes moved, bytes/s, the ratios naive/verified and unverified/verified, and the
verification's share of the verified sync (1 - unverified/verified).
Usage:  OMP_NUM_THREADS=2 .venv/bin/python bench/bench_weight_sync.py [--dtype float32] [--repeats 3]
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


def naive_sync(model, provider, engine, directory: Path) -> float:
    from model_providers.hf_checkpoint import export_hf_checkpoint

    start = time.perf_counter()
    export_hf_checkpoint(model, provider, directory, overwrite=True, dtype=model_dtype(model))
    engine.run_in_worker(lambda worker: worker.reload_weights(weights_path=str(directory)))
    engine.llm.reset_prefix_cache()
    return time.perf_counter() - start


def unverified_sync(model, provider, engine) -> float:
    from model_providers.hf_checkpoint import iter_hf_weights

    start = time.perf_counter()
    weights = iter_hf_weights(model, provider, copies=False)
    engine.run_in_worker(lambda worker: worker.reload_weights(weights_iterator=weights))
    engine.llm.reset_prefix_cache()
    return time.perf_counter() - start


def model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(torch.get_num_threads())  # fixed before vLLM freezes it

    import dataclasses

    from megarlhf.config.model import ModelConfig
    from megarlhf.config.schema import RunConfig
    from megarlhf.config.data import DataConfig
    from megarlhf.config.rollout import RolloutConfig, WeightSyncConfig
    from megarlhf.rollout.sync.calibration import calibrate_colocated
    from megarlhf.rollout.engines import EngineConfig
    from megarlhf.rollout.engines.vllm import VLLMEngine
    from megarlhf.rollout.sync.weights import WeightSync
    from megarlhf.learner import TrainModel
    from model_providers.hf_checkpoint import load_hf_model
    from model_providers.tiny_models import QWEN2_0_5B_SHAPE, make_tiny_model
    from megarlhf.config.parallel import ParallelConfig
    from parallel.runtime import init_parallel

    runtime = init_parallel(ParallelConfig())
    with tempfile.TemporaryDirectory() as tmp:
        src = make_tiny_model("qwen2", Path(tmp) / "src", seed=0, dtype=dtype, **QWEN2_0_5B_SHAPE)
        config = RunConfig(model=ModelConfig(path=str(src), dtype=args.dtype),
                           data=DataConfig(train_path="unused.jsonl", max_prompt_length=256),
                           rollout=RolloutConfig(max_new_tokens=256, kv_cache_mb=256,
                                                 weight_sync=WeightSyncConfig(bucket_mb=args.bucket_mb)))
        provider, model = load_hf_model(src, params_dtype=dtype, packed_sequences=True)
        actor = TrainModel("actor", model, provider, runtime)
        engine = VLLMEngine(str(src), EngineConfig.from_rollout(config.rollout, model_dtype=args.dtype, seed=0,
                                                                   max_prompt_length=256))
        unprobed = dataclasses.replace(config, rollout=dataclasses.replace(
            config.rollout, weight_sync=WeightSyncConfig(bucket_mb=args.bucket_mb, probe_sequences=0)))
        sync = WeightSync(engine, actor, unprobed)
        probe = WeightSync(engine, actor, config)
        calibrate_colocated(probe, [], ())
        streamed, unverified, naive, fingerprints, metrics = [], [], [], [], {}
        for _ in range(args.repeats):
            metrics = sync.sync()
            streamed.append(metrics["time/weight_sync_s"])
            fingerprints.append(metrics["time/weight_sync_fingerprint_trainer_s"]
                                + metrics["time/weight_sync_fingerprint_engine_s"])
            unverified.append(unverified_sync(model, provider, engine))
            naive.append(naive_sync(model, provider, engine, Path(tmp) / "naive"))
        probed = probe.sync()
    size = metrics["weight_sync/bytes"]
    s, u, n = statistics.median(streamed), statistics.median(unverified), statistics.median(naive)
    print(f"model: Qwen2-0.5B shape, {args.dtype}, {size / 2**30:.2f} GiB in {metrics['weight_sync/tensors']:.0f} "
          f"tensors; torch threads {torch.get_num_threads()}; median of {args.repeats}")
    print(f"verified ({metrics['weight_sync/buckets']:.0f} buckets <= {args.bucket_mb:g} MB): "
          f"{s:.2f} s  {size / s / 2**20:.0f} MiB/s   runs {[round(x, 2) for x in streamed]}")
    print(f"naive (safetensors on disk + reload from path, unverified): {n:.2f} s  {size / n / 2**20:.0f} MiB/s   "
          f"runs {[round(x, 2) for x in naive]}")
    print(f"unverified (same tensors into reload_weights, nothing checked): {u:.2f} s  {size / u / 2**20:.0f} MiB/s"
          f"   runs {[round(x, 2) for x in unverified]}")
    f = statistics.median(fingerprints)
    print(f"ratio naive / verified: {n / s:.2f}x   unverified / verified: {u / s:.2f}x   "
          f"verification's share of the verified sync: {max(0.0, 1 - u / s):.0%}")
    print(f"fingerprints (trainer + engine, {2 * size / 2**30:.2f} GiB hashed): {f:.2f} s, {f / s:.0%} of the "
          f"verified sync   runs {[round(x, 2) for x in fingerprints]}")
    print(f"probe forward (2 x 32 tokens, trainer + engine): {probed['time/weight_sync_probe_s']:.2f} s, "
          f"max |diff| {probed['weight_sync/probe_max_abs_diff']:.2e}")


if __name__ == "__main__":
    main()
