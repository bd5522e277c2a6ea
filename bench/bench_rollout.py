"""Benchmark: rollout throughput through ``VLLMEngine`` vs bare vLLM, and per-rank vs TP=2 engines.

1. Wrapper vs bare (one process): the same in-process vLLM engine generates the same batch (default
   256 prompts x 64 new tokens, temperature 1, seeded, sampled-token log-probs on, EOS ignored so every
   sample has the same length) once through ``VLLMEngine.generate`` and once through
   ``LLM.generate`` with equivalent ``SamplingParams``; alternated, best of ``--repeats``.
2. Layouts on 2 ranks (``--layouts``; torchrun, one thread per rank): one TP=1 engine per rank, each
   generating half the prompts, vs one TP=2 engine (``external_launcher``) generating all of them;
   aggregate unique generated tokens per second (slowest rank's time).

Model: the tiny Qwen2 of ``model_providers.tiny_models`` (hidden 128, 2 layers, vocab 384, fp32) or
``--hidden/--layers`` overrides. Usage:
  OMP_NUM_THREADS=1 .venv/bin/python bench/bench_rollout.py [--prompts 256] [--new-tokens 64] [--layouts]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prompts(n: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (16,), generator=gen).tolist() for _ in range(n)]


def sampling(args):
    from megarlhf.rollout.engines.sampling import SamplingConfig

    return SamplingConfig(n=1, temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=1)


def engine_config(kv_cache_mb: int, **rollout):
    """The engine config a run with these rollout settings would build (fp32, 256-token sequences)."""
    from megarlhf.config.rollout import RolloutConfig
    from megarlhf.rollout.engines import EngineConfig

    return EngineConfig.from_rollout(RolloutConfig(kv_cache_mb=kv_cache_mb, max_new_tokens=128, **rollout),
                                     model_dtype="float32", seed=0, max_prompt_length=128)


def bare_generate(llm, prompt_list, cfg) -> int:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens, ignore_eos=True,
                             seed=cfg.seed + i, logprobs=0, detokenize=False) for i in range(len(prompt_list))]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_list], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)


def wrapper_vs_bare(args, model_dir: str) -> None:
    from megarlhf.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(model_dir, engine_config(512, enforce_eager=not args.compile))
    prompt_list, cfg = prompts(args.prompts, engine.vocab_size), sampling(args)
    engine.generate(prompt_list[:8], cfg)  # warm-up
    best = {"wrapper": float("inf"), "bare": float("inf")}
    tokens = {}
    for _ in range(args.repeats):
        for name in best:
            start = time.perf_counter()
            tokens[name] = (engine.generate(prompt_list, cfg).num_tokens if name == "wrapper"
                            else bare_generate(engine.llm, prompt_list, cfg))
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"{args.prompts} prompts x {args.new_tokens} tokens, torch threads {torch.get_num_threads()}, "
          f"enforce_eager={not args.compile}, best of {args.repeats}")
    for name in best:
        print(f"  {name:8s} {tokens[name]} tokens in {best[name]:.3f} s = {tokens[name] / best[name]:,.0f} tok/s")
    print(f"  wrapper / bare throughput: {best['bare'] / best['wrapper']:.3f}")


def rank_run(args, model_dir: str, engine_tp: int, out: str) -> None:
    import torch.distributed as dist

    from megarlhf.rollout.engines.vllm import VLLMEngine
    from parallel.runtime import init_distributed

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = VLLMEngine(model_dir, engine_config(256, tensor_parallel_size=engine_tp))
    all_prompts, cfg = prompts(args.prompts, engine.vocab_size), sampling(args)
    mine = all_prompts if engine_tp > 1 else all_prompts[rank::world]
    engine.generate(mine[:8], cfg)
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        n = engine.generate(mine, cfg).num_tokens
        times.append(time.perf_counter() - start)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"tokens": n, "best_s": min(times)}))


def layouts(args, model_dir: str) -> None:
    from megarlhf.testing.launch import read_rank_results, run_torchrun

    print(f"2 ranks, 1 thread each, {args.prompts} prompts x {args.new_tokens} tokens (unique tokens, slowest rank)")
    for engine_tp, name in ((1, "per-rank TP=1 engines"), (2, "one TP=2 engine")):
        with tempfile.TemporaryDirectory() as out:
            run_torchrun(__file__, 2, ["--rank-run", str(engine_tp), out, "--model", model_dir,
                                       "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens),
                                       "--repeats", str(args.repeats)], timeout_s=1200)
            res = read_rank_results(out, 2)
        unique = sum(r["tokens"] for r in res) if engine_tp == 1 else res[0]["tokens"]
        slowest = max(r["best_s"] for r in res)
        print(f"  {name:22s} {unique} tokens in {slowest:.3f} s = {unique / slowest:,.0f} tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="let vLLM torch.compile (enforce_eager=False)")
    parser.add_argument("--layouts", action="store_true", help="also compare per-rank vs TP=2 engines")
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank-run", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.rank_run:
        rank_run(args, args.model, int(args.rank_run[0]), args.rank_run[1])
        return
    from model_providers.tiny_models import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model("qwen2", Path(tmp) / "qwen2", seed=0))
        wrapper_vs_bare(args, model_dir)
        if args.layouts:
            layouts(args, model_dir)


if __name__ == "__main__":
    main()
