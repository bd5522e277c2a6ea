#!/usr/bin/env python
"""Writes a tiny random HF model (config, safetensors, locally trained tokenizer) for tests and examples.

    python tools/make_tiny_model.py --arch qwen2 --out /tmp/tiny-qwen2
    python tools/make_tiny_model.py --arch qwen2 --qwen2-0.5b-shape --dtype bfloat16 --out /tmp/q05b
    python tools/make_tiny_model.py --arch llama --set num_hidden_layers=2 --set hidden_size=256 --out ...

A thin CLI over :func:`model_providers.tiny_models.make_tiny_model`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarlhf.core.quiet import quiet_environment  # noqa: E402

quiet_environment()  # before transformers is imported: no progress bar per shard written

import torch  # noqa: E402

from model_providers.tiny_models import QWEN2_0_5B_SHAPE, TINY_CONFIGS, make_tiny_model  # noqa: E402


def parse_override(text: str) -> tuple[str, object]:
    """``key=value`` with a JSON value (numbers, true/false, null, lists); bare words stay strings."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True, choices=sorted(TINY_CONFIGS))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--qwen2-0.5b-shape", dest="qwen2_shape", action="store_true",
                        help="Qwen2-0.5B sizes: hidden 896, 24 layers, 14 heads, 2 kv heads, ffn 4864, "
                             "vocab 151936, tied")
    parser.add_argument("--set", dest="overrides", action="append", type=parse_override, default=[],
                        metavar="KEY=VALUE", help="override a config field (repeatable)")
    args = parser.parse_args(argv)
    overrides = {**(QWEN2_0_5B_SHAPE if args.qwen2_shape else {}), **dict(args.overrides)}
    out = make_tiny_model(args.arch, args.out, seed=args.seed, dtype=getattr(torch, args.dtype), **overrides)
    print(out)
    return out


if __name__ == "__main__":
    main()
