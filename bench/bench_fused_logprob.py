"""Peak memory and time of the fused log-prob/entropy op vs the naive full-logits version on CPU.

Both variants run forward + backward of loss = sum(ra * logprob) + sum(rb * entropy) on the same
inputs. naive: logits = hidden @ weight.T (fp32, or bf16 upcast to fp32) -> log_softmax -> gather;
entropy = -(exp(logp) * logp).sum(). fused: megarlhf.ops.fused_logprob_entropy (torch backend).

How it measures (one fresh subprocess per variant/dtype/tokens, so allocator state and peaks do not
leak between variants):
  * peak memory: the child's peak RSS (getrusage ru_maxrss, the kernel's high-water mark of
    resident pages), reported raw and as "working" memory = peak RSS - RSS right after the inputs
    (hidden, weight, targets) were created. Raw includes the interpreter, torch, the inputs and
    grad_weight, which both variants need.
  * time: wall time (perf_counter) and process CPU time (process_time, less sensitive to other
    processes sharing the cores) of one forward+backward, best of --iters.
A naive run whose estimated peak (from the working-memory-per-logit of the naive runs measured so
far; 6 fp32 logit tensors before any) exceeds --mem-limit-gb is not run; its memory and time are
then projected linearly in tokens from the two largest measured naive runs and marked "proj".

Usage:
  OMP_NUM_THREADS=2 .venv/bin/python bench/bench_fused_logprob.py \
      --tokens 1024 2048 8192 --dtypes fp32 bf16 --mem-limit-gb 12
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

DTYPES = ("fp32", "bf16")


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def child(variant: str, dtype_name: str, tokens: int, hidden: int, vocab: int, chunk: int,
          threads: int, iters: int) -> dict:
    """Runs one variant in this (fresh) process and returns its measurements."""
    import torch
    from megarlhf.ops import LogprobOptions, fused_logprob_entropy

    torch.set_num_threads(threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5 * 2).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    ra, rb = torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen)
    rss_inputs = _rss_bytes()

    def naive():
        logp = torch.log_softmax((x @ w.t()).float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(1, targets[:, None]).squeeze(1), entropy

    def fused():
        return fused_logprob_entropy(x, w, targets, options=LogprobOptions(chunk_size=chunk))

    fn = {"naive": naive, "fused": fused}[variant]
    walls, cpus, checksum = [], [], 0.0
    for _ in range(iters):
        x.grad = w.grad = None
        t_wall, t_cpu = time.perf_counter(), time.process_time()
        logprob, entropy = fn()
        ((ra * logprob).sum() + (rb * entropy).sum()).backward()
        walls.append(time.perf_counter() - t_wall)
        cpus.append(time.process_time() - t_cpu)
        checksum = [float(logprob.sum()), float(entropy.sum()), float(x.grad.float().norm()),
                    float(w.grad.float().norm())]
        del logprob, entropy
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak": peak, "working": peak - rss_inputs, "wall": min(walls), "cpu": min(cpus),
            "checksum": checksum}


def run_child(args, variant: str, dtype_name: str, tokens: int) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--dtypes", dtype_name,
           "--tokens", str(tokens), "--hidden", str(args.hidden), "--vocab", str(args.vocab),
           "--chunk", str(args.chunk), "--threads", str(args.threads), "--iters", str(args.iters)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} {dtype_name} tokens={tokens} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def project(points: dict[int, dict], tokens: int) -> dict:
    """Linear-in-tokens projection through the two largest measured token counts."""
    (t0, r0), (t1, r1) = sorted(points.items())[-2:]
    return {key: r1[key] + (r1[key] - r0[key]) * (tokens - t1) / (t1 - t0)
            for key in ("peak", "working", "wall", "cpu")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--mem-limit-gb", type=float, default=12.0)
    parser.add_argument("--child", choices=("naive", "fused"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = child(args.child, args.dtypes[0], args.tokens[0], args.hidden, args.vocab,
                       args.chunk, args.threads, args.iters)
        print(json.dumps(result))
        return

    gb = 1024 ** 3
    print(f"hidden={args.hidden} vocab={args.vocab} chunk={args.chunk} threads={args.threads} "
          f"iters={args.iters} (best of); memory = peak RSS of a fresh process per run; "
          f"working = peak RSS - RSS after inputs")
    print(f"{'dtype':5} {'tokens':>6} {'variant':7} {'peak GB':>8} {'work GB':>8} {'wall s':>7} "
          f"{'cpu s':>7}  checksum(sum lp, sum ent, |g_h|, |g_w|)")
    for dtype_name in args.dtypes:
        naive_points: dict[int, dict] = {}
        per_logit = 6 * 4.0   # bytes of working memory per logit before any naive is measured
        for tokens in sorted(args.tokens):
            logits = tokens * args.vocab
            rows = {"fused": (run_child(args, "fused", dtype_name, tokens), "")}
            if per_logit * logits / gb <= args.mem_limit_gb:
                naive = run_child(args, "naive", dtype_name, tokens)
                naive_points[tokens] = naive
                per_logit = max(r["working"] / (t * args.vocab) for t, r in naive_points.items())
                rows["naive"] = (naive, "")
            elif len(naive_points) >= 2:
                rows["naive"] = (project(naive_points, tokens), "proj")
            for variant in ("naive", "fused"):
                if variant not in rows:
                    print(f"{dtype_name:5} {tokens:6d} {variant:7} not run: needs ~"
                          f"{per_logit * logits / gb:.1f} GB > --mem-limit-gb, <2 points to project")
                    continue
                r, note = rows[variant]
                print(f"{dtype_name:5} {tokens:6d} {variant:7} {r['peak'] / gb:8.2f} "
                      f"{r['working'] / gb:8.2f} {r['wall']:7.2f} {r['cpu']:7.2f}  "
                      f"{note or ' '.join(f'{c:.6g}' for c in r['checksum'])}")
            if "naive" in rows:
                f, n = rows["fused"][0], rows["naive"][0]
                print(f"{dtype_name:5} {tokens:6d} fused/naive{' (naive proj)' if rows['naive'][1] else ''}: "
                      f"peak {f['peak'] / n['peak']:.3f}  working {f['working'] / n['working']:.3f}  "
                      f"wall {f['wall'] / n['wall']:.3f}  cpu {f['cpu'] / n['cpu']:.3f}", flush=True)


if __name__ == "__main__":
    main()
