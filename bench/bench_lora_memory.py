"""Benchmark: trainer-side memory of full fine-tuning vs LoRA on the same model, side by side.

Each variant runs in a fresh process (peak RSS is per process): build the actor as a run does
(``build_actor``: Megatron DDP, distributed optimizer off, fp32 or bf16), take two SFT optimizer steps on
the same synthetic batch (``--rows`` x ``--length`` tokens), and report the process's peak resident set,
the bytes of the optimizer state (Adam's moments, and master copies in bf16), of the gradient buffers
and the parameter counts (trainable, frozen), plus the planner's figures for the same config.
Prints each variant and the ratios LoRA / full.
Usage:  .venv/bin/python bench/bench_lora_memory.py [--model DIR] [--rank 16] [--dtype float32]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def child(args) -> dict:
    from megarlhf.config import RunConfig, from_dict
    from megarlhf.data.sft import SFTExample
    from megarlhf.planner import Launch, plan_memory
    from megarlhf.planner.shapes import resolve_shape
    from megarlhf.rollout.colocate import torch_optimizers
    from megarlhf.learner import build_actor, sft_step
    from megarlhf.config.parallel import ParallelConfig
    from parallel.runtime import init_parallel

    tree = {"model": {"path": args.model, "dtype": args.dtype}, "data": {"train_path": "unused.jsonl"},
            "optim": {"use_distributed_optimizer": False}, "algorithm": {"kl_mode": "none"},
            "train": {"global_batch_size": args.rows, "micro_batch_tokens": args.rows * args.length}}
    if args.rank:
        tree["model"]["lora"] = {"rank": args.rank, "alpha": 2.0 * args.rank}
    config = from_dict(RunConfig, tree)
    runtime = init_parallel(ParallelConfig(), seed=0)
    actor = build_actor(config, runtime, total_steps=10)
    gen = torch.Generator().manual_seed(0)
    vocab = actor.vocab_size
    examples = [SFTExample(input_ids=torch.randint(3, vocab, (args.length,), generator=gen).tolist(),  # host: bench
                           loss_mask=[0] * (args.length // 2) + [1] * (args.length - args.length // 2))
                for _ in range(args.rows)]
    start = time.perf_counter()
    for _ in range(2):
        sft_step(actor, examples, config)
    seconds = (time.perf_counter() - start) / 2
    params = list(actor.model.parameters())
    optimizer = sum(_tensor_bytes(list(opt.state.values())) for opt in torch_optimizers(actor.optimizer))
    grads = sum(_tensor_bytes(buffer.grad_data) for buffer in actor.model.buffers)
    plan = plan_memory(config, resolve_shape(args.model)[0], Launch(world_size=1, device="cpu")).stages[0]
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "optimizer_bytes": optimizer, "grad_buffer_bytes": grads, "step_s": seconds,
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "frozen": sum(p.numel() for p in params if not p.requires_grad),
            "planned_optimizer_bytes": plan.components["actor_optimizer"],
            "planned_grad_bytes": plan.components["actor_grads"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory (default: a tiny random Qwen2)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from model_providers.tiny_models import make_tiny_model

            args.model = str(make_tiny_model("qwen2", Path(tmp) / "model", seed=0))
        results = {}
        for name, rank in (("full", 0), ("lora", args.rank)):
            cmd = [sys.executable, __file__, "--child", "--model", args.model, "--rank", str(rank), "--dtype",
                   args.dtype, "--rows", str(args.rows), "--length", str(args.length)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            results[name] = json.loads(out.strip().splitlines()[-1])
    print(f"model {args.model}, {args.dtype}, plain Adam, {args.rows} x {args.length} tokens, LoRA rank {args.rank} "
          f"on every linear layer")
    for key in ("trainable", "frozen", "optimizer_bytes", "planned_optimizer_bytes", "grad_buffer_bytes",
                "planned_grad_bytes", "peak_rss_bytes", "step_s"):
        full, lora = results["full"][key], results["lora"][key]
        ratio = f"{lora / full:.3f}" if full else "-"
        print(f"  {key:24s} full {full:>14,.2f}   lora {lora:>14,.2f}   lora/full {ratio}")


if __name__ == "__main__":
    main()
