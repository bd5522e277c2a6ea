"""The log-prob / entropy op's backends side by side on one GPU: forward-only (scoring) and forward +
backward (training) time, peak memory, and the largest log-prob difference from an fp32 full-logits
reference, for the full-logits naive version, the chunked torch op, and the Triton forward (whose
backward is the torch op's chunked one).

    python3 bench/bench_logprob_backends.py [--tokens 8192] [--shapes 2048x32768 1024x151936]
        [--dtypes bfloat16 float32] [--repeats 5]

Times are CUDA-event medians after one warm-up (Triton compiles there). Without CUDA it runs the
naive and torch variants at a small size (a dry run of the script, no Triton).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _naive(h, w, t):
    logits = (h @ w.t()).float()
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, t[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _variants(on_gpu: bool) -> dict:
    from megarlhf.ops import fused_logprob_entropy

    variants = {"naive (full logits)": _naive, "torch chunked": lambda h, w, t: fused_logprob_entropy(h, w, t)}
    if on_gpu:
        from megarlhf.ops.triton_logprob import triton_logprob_entropy

        variants["triton fwd + chunked bwd"] = lambda h, w, t: triton_logprob_entropy(h, w, t)
    return variants


def _measure(fn, hidden, weight, targets, train: bool, repeats: int) -> tuple[float, float, torch.Tensor]:
    """(median ms, peak MiB above the inputs, log-probs) of ``repeats`` calls after one warm-up."""
    cuda = hidden.is_cuda
    times, lp = [], None
    for i in range(repeats + 1):
        h, w = hidden.detach().requires_grad_(train), weight.detach().requires_grad_(train)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            import time
            t0 = time.perf_counter()
        with torch.set_grad_enabled(train):
            lp, ent = fn(h, w, targets)
            if train:
                (lp.sum() + 0.1 * ent.sum()).backward()
        if cuda:
            end.record()
            torch.cuda.synchronize()
            ms, peak = start.elapsed_time(end), (torch.cuda.max_memory_allocated() - base) / 2**20
        else:
            ms, peak = (time.perf_counter() - t0) * 1e3, float("nan")
        if i:
            times.append(ms)
    return statistics.median(times), peak, lp.detach().float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--shapes", nargs="+", default=["2048x32768", "1024x151936"], help="HIDDENxVOCAB")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    tokens = args.tokens if on_gpu else 256
    print(f"log-prob op backends on {torch.cuda.get_device_name(0) if on_gpu else 'cpu (dry run)'}, "
          f"{tokens} tokens, median of {args.repeats}")
    for shape in args.shapes:
        hidden_size, vocab = (int(x) for x in shape.split("x"))
        if not on_gpu:
            hidden_size, vocab = min(hidden_size, 64), min(vocab, 1024)
        gen = torch.Generator(device=device).manual_seed(0)
        h32 = torch.randn(tokens, hidden_size, device=device, generator=gen)
        w32 = 0.02 * torch.randn(vocab, hidden_size, device=device, generator=gen)
        targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
        with torch.no_grad():
            reference = _naive(h32, w32, targets)[0]
        for dtype in args.dtypes:
            hidden, weight = h32.to(getattr(torch, dtype)), w32.to(getattr(torch, dtype))
            print(f"\nhidden {hidden_size}, vocab {vocab}, {dtype}:")
            print(f"  {'variant':26s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'fwd MiB':>8s} {'train MiB':>10s} "
                  f"{'max |lp - fp32|':>16s}")
            for name, fn in _variants(on_gpu).items():
                fwd_ms, fwd_mib, lp = _measure(fn, hidden, weight, targets, False, args.repeats)
                train_ms, train_mib, _ = _measure(fn, hidden, weight, targets, True, args.repeats)
                print(f"  {name:26s} {fwd_ms:8.2f} {train_ms:11.2f} {fwd_mib:8.0f} {train_mib:10.0f} "
                      f"{float((lp - reference).abs().max()):16.2e}")


if __name__ == "__main__":
    main()
