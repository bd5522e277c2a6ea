"""RoPE on packed (thd) sequences: Megatron's per-sequence loop vs parallel.megatron_fallbacks' vectorised one.

Both variants run forward + backward of RoPE on the same packed query tensor, as attention does (twice
per layer: query and key). The shape is an RL/SFT micro-batch of the demo: many short sequences.
Reports the best-of-N wall time of each, their ratio, and checks that outputs are bitwise equal.

    .venv/bin/python bench/bench_rope_thd.py [--sequences 64] [--length 60] [--heads 8] [--head-dim 32]
        [--device cuda] [--dtype bfloat16]

On a GPU, Megatron's loop reads one length per sequence to the host (a queue drain each); the timings
synchronise the device before reading the clock.
"""
from __future__ import annotations

import argparse
import time

import torch


class _OneRank:
    """A context-parallel group of size 1, as Megatron passes it."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, t, cu_seqlens, freqs, iters: int) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), None
    for _ in range(iters):
        x = t.detach().requires_grad_()
        _synchronize(t.device)
        start = time.perf_counter()
        out = fn(x, cu_seqlens, freqs, cp_group=_OneRank())
        out.sum().backward()
        _synchronize(t.device)
        best = min(best, time.perf_counter() - start)
    return best, out.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--length", type=int, default=60, help="mean sequence length (lengths vary +-50%%)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    from megatron.core.models.common.embeddings import rope_utils

    from parallel import megatron_fallbacks

    megatron_fallbacks.install()
    patched = rope_utils._apply_rotary_pos_emb_thd
    megatron = patched.__wrapped__
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.length // 2, args.length * 3 // 2 + 1, (args.sequences,), generator=g)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()]).to(device)
    freqs = torch.rand(int(lengths.max()), 1, 1, args.head_dim, generator=g).to(device)  # fp32, as Megatron's
    t = torch.randn(int(lengths.sum()), args.heads, args.head_dim, generator=g).to(device, dtype)
    loop_s, loop_out = _time(megatron, t, cu_seqlens, freqs, args.iters)
    vec_s, vec_out = _time(patched, t, cu_seqlens, freqs, args.iters)
    print(f"packed RoPE on {device} ({args.dtype}), {args.sequences} sequences / {int(lengths.sum())} tokens, {args.heads} heads x "
          f"{args.head_dim}, forward+backward, best of {args.iters}:")
    print(f"  megatron loop   {1e3 * loop_s:8.2f} ms")
    print(f"  vectorised      {1e3 * vec_s:8.2f} ms   (vectorised / loop = {vec_s / loop_s:.3f})")
    print(f"  outputs bitwise equal: {torch.equal(loop_out, vec_out)}")


if __name__ == "__main__":
    main()
