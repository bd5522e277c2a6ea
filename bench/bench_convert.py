"""Benchmark: HF -> Megatron -> HF conversion of a Qwen2-0.5B-shaped checkpoint on CPU, megarlhf vs naive.

The source is a random checkpoint with Qwen2-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads,
ffn 4864, vocab 151936, tied embeddings; 494M parameters) made by ``model_providers.tiny_models``.

Variants, each direction in a fresh process (one thread):

* megarlhf: ``megarlhf convert hf-to-megatron`` (each tensor read from the safetensors file straight into
  the built model, then a torch_dist distributed checkpoint) and ``megarlhf convert megatron-to-hf``
  (model built, checkpoint loaded, tensors streamed into safetensors files by the exporter).
* naive: the whole HF state dict loaded with ``safetensors.torch.load_file``, every tensor renamed /
  fused into Megatron's layout (the same mapping table, full tensors, TP=1) into a second dict, and one
  ``torch.save`` file; back: ``torch.load`` of that file, every tensor split / renamed into a new dict,
  ``save_file``.

Also shown: megarlhf's export with ``--max-shard-mib 256`` (several safetensors files and an index; the
exporter holds one file's tensors at a time).

Measured per process: conversion time (imports excluded; the parent also reports the whole process);
the rise of anonymous memory (RssAnon sampled every 2 ms: what the conversion itself allocates); the
rise of the RSS high-water mark (VmHWM reset through /proc/self/clear_refs once the imports are done; it
also counts page-cache pages of mmap-read files, which the kernel can reclaim); the process's peak RSS. Both outputs are checked bit-identical to the source.

Usage:  OMP_NUM_THREADS=1 .venv/bin/python bench/bench_convert.py [--dtype bfloat16] [--repeats 3] [--work DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CAPPED_SHARD_MIB = 256
sys.path.insert(0, str(ROOT))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> int:
    """Resets VmHWM to the current RSS (Linux clear_refs "5") and returns that RSS in KiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


class _AnonSampler:
    """Samples RssAnon every 2 ms in a thread: the kernel keeps no high-water mark of anonymous memory,
    and VmHWM also counts the (reclaimable) page-cache pages of mmap-read safetensors files."""

    def __init__(self):
        import threading

        self.baseline = self.peak = _status_kib("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _status_kib("RssAnon"))

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        return self.baseline, max(self.peak, _status_kib("RssAnon"))


# ---- the naive way ---------------------------------------------------------------------------------
def _expanded(provider):
    """(megatron name, hf names, kind) for every entry of the mapping table, per layer (TP=1)."""
    entries = []
    for m in provider.mappings():
        layers = range(provider.hf_config.num_hidden_layers) if m.per_layer else [None]
        for layer in layers:
            fmt = (lambda s: s.format(layer=layer)) if layer is not None else (lambda s: s)
            entries.append((fmt(m.megatron), tuple(fmt(h) for h in m.hf), m.kind, m.export))
    return entries


def naive_to_megatron(hf_dir: Path, out: Path) -> None:
    from safetensors.torch import load_file
    import torch

    from model_providers import get_provider

    provider = get_provider(hf_dir)
    ctx = provider.shard_context(0, 1)
    hf = load_file(str(hf_dir / "model.safetensors"))
    megatron = {name: kind.load([hf[h] for h in hf_names], ctx).clone()
                for name, hf_names, kind, _ in _expanded(provider)}
    out.mkdir(parents=True)
    torch.save(megatron, out / "model.pt")
    shutil.copy2(hf_dir / "config.json", out / "config.json")


def naive_to_hf(ckpt: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from model_providers import get_provider

    provider = get_provider(ckpt)
    ctx = provider.shard_context(0, 1)
    megatron = torch.load(ckpt / "model.pt", weights_only=True)
    hf = {}
    for name, hf_names, kind, export in _expanded(provider):
        if export:
            hf.update(zip(hf_names, kind.export([megatron[name]], ctx)))
    out.mkdir(parents=True)
    save_file(hf, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy2(ckpt / "config.json", out / "config.json")


# ---- one measured process ----------------------------------------------------------------------------
def run_stage(stage: str, src: Path, dst: Path) -> dict:
    import torch  # noqa: F401  (imports before the measurement starts)

    from megarlhf.cli import main as megarlhf_main
    from model_providers import get_provider  # noqa: F401

    if stage.startswith("megarlhf"):
        import megatron.core  # noqa: F401
        import transformers  # noqa: F401

    baseline = _reset_peak()
    sampler = _AnonSampler()
    start = time.perf_counter()
    if stage == "megarlhf-to-megatron":
        assert megarlhf_main(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(dst)]) == 0
    elif stage == "megarlhf-to-hf":
        assert megarlhf_main(["convert", "megatron-to-hf", "--ckpt", str(src), "--out", str(dst)]) == 0
    elif stage == "megarlhf-to-hf-capped":
        assert megarlhf_main(["convert", "megatron-to-hf", "--ckpt", str(src), "--out", str(dst),
                              "--max-shard-mib", str(CAPPED_SHARD_MIB)]) == 0
    elif stage == "naive-to-megatron":
        naive_to_megatron(src, dst)
    elif stage == "naive-to-hf":
        naive_to_hf(src, dst)
    seconds = time.perf_counter() - start
    anon_baseline, anon_peak = sampler.stop()
    return {"seconds": seconds, "baseline_mib": baseline / 1024, "peak_mib": _status_kib("VmHWM") / 1024,
            "anon_rise_mib": (anon_peak - anon_baseline) / 1024}


def make_source(out: Path, dtype: str) -> None:
    import torch

    from model_providers.tiny_models import QWEN2_0_5B_SHAPE, make_tiny_model

    make_tiny_model("qwen2", out, seed=0, dtype=getattr(torch, dtype), **QWEN2_0_5B_SHAPE)


def identical(a: Path, b: Path) -> bool:
    """Every tensor of two HF directories equal (streamed tensor by tensor; handles sharded indexes)."""
    import torch
    from safetensors import safe_open

    def tensors(directory: Path):
        index = directory / "model.safetensors.index.json"
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
                 else ["model.safetensors"])
        return {name: directory / f for f in files for name in safe_open(directory / f, "pt").keys()}

    ta, tb = tensors(a), tensors(b)
    if ta.keys() != tb.keys():
        return False
    for name in ta:
        with safe_open(ta[name], "pt") as fa, safe_open(tb[name], "pt") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            if x.dtype != y.dtype or not torch.equal(x, y):
                return False
    return True


def _child(args: list[str]) -> tuple[dict, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return (json.loads(lines[-1][len("RESULT "):]) if lines else {}), wall


def measure_all(work: Path, source: Path, repeats: int) -> tuple[dict, dict]:
    """Runs every variant ``repeats`` times; returns per (variant, direction) the fastest time and the
    largest memory figures, and per variant whether every run's output equalled the source."""
    runs: dict[tuple[str, str], list[dict]] = {}
    identical_outputs: dict[str, bool] = {}

    def measure(key: tuple[str, str], stage: str, src: Path, dst: Path) -> None:
        shutil.rmtree(dst, ignore_errors=True)
        result, wall = _child(["--stage", stage, "--src", str(src), "--dst", str(dst)])
        runs.setdefault(key, []).append({**result, "process_s": wall})

    for _ in range(repeats):  # interleaved, so that load changes on a shared machine hit all variants
        for variant in ("megarlhf", "naive"):
            mid, back = work / f"{variant}-megatron", work / f"{variant}-hf"
            measure((variant, "to-megatron"), f"{variant}-to-megatron", source, mid)
            measure((variant, "to-hf"), f"{variant}-to-hf", mid, back)
            identical_outputs[variant] = identical_outputs.get(variant, True) and identical(source, back)
        capped = work / "megarlhf-hf-capped"
        measure(("megarlhf", f"to-hf {CAPPED_SHARD_MIB}M"), "megarlhf-to-hf-capped", work / "megarlhf-megatron", capped)
        identical_outputs["megarlhf-capped"] = identical_outputs.get("megarlhf-capped", True) and identical(
            source, capped)
    # Fastest run for times (least disturbed by other load); memory barely varies, take the largest.
    rows = {key: {"seconds": min(r["seconds"] for r in results), "process_s": min(r["process_s"] for r in results),
                  "anon_rise_mib": max(r["anon_rise_mib"] for r in results),
                  "rss_rise_mib": max(r["peak_mib"] - r["baseline_mib"] for r in results),
                  "peak_mib": max(r["peak_mib"] for r in results)}
            for key, results in runs.items()}
    return rows, identical_outputs


def print_report(rows: dict, identical_outputs: dict) -> None:
    print(f"{'variant':9} {'direction':13} {'convert s':>9} {'process s':>9} {'anon-rise MiB':>13} "
          f"{'rss-rise MiB':>12} {'peak MiB':>9}")
    for (variant, direction), r in rows.items():
        print(f"{variant:9} {direction:13} {r['seconds']:9.1f} {r['process_s']:9.1f} {r['anon_rise_mib']:13.0f} "
              f"{r['rss_rise_mib']:12.0f} {r['peak_mib']:9.0f}")
    print("round trip bit-identical:", identical_outputs)
    print("\nratios naive / megarlhf (>1: megarlhf is better):")
    for direction in ("to-megatron", "to-hf"):
        m, n = rows[("megarlhf", direction)], rows[("naive", direction)]
        print(f"  {direction:12} time {n['seconds'] / m['seconds']:.2f}x   process time "
              f"{n['process_s'] / m['process_s']:.2f}x   anon-rise {n['anon_rise_mib'] / m['anon_rise_mib']:.2f}x   "
              f"rss-rise {n['rss_rise_mib'] / m['rss_rise_mib']:.2f}x   peak {n['peak_mib'] / m['peak_mib']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (fastest time is shown)")
    parser.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # internal: one measured process
    parser.add_argument("--src", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dst", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage == "make":
        make_source(Path(args.dst), args.dtype)
        return
    if args.stage:
        print("RESULT " + json.dumps(run_stage(args.stage, Path(args.src), Path(args.dst))))
        return

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_convert_"))
    source = work / f"source-{args.dtype}"
    if not source.exists():
        _, wall = _child(["--stage", "make", "--dst", str(source), "--dtype", args.dtype])
        print(f"made {source} ({args.dtype}) in {wall:.0f} s")
    rows, identical_outputs = measure_all(work, source, args.repeats)
    size = (source / "model.safetensors").stat().st_size / 2**20
    print(f"\nsource: Qwen2-0.5B shape, {args.dtype}, model.safetensors {size:.0f} MiB; 1 thread per process; "
          f"fastest of {args.repeats} runs")
    print_report(rows, identical_outputs)
    if not args.work:
        shutil.rmtree(work)


if __name__ == "__main__":  # required: the checkpoint saver spawns a multiprocessing Manager
    main()
