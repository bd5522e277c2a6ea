"""Converts between HF model directories and megarlhf distributed checkpoints.

Same as ``megarlhf convert``; see megarlhf/checkpoint/convert.py. Examples:

    python tools/convert_checkpoint.py hf-to-megatron --hf ./Qwen2-0.5B --out ./ckpt
    torchrun --nproc-per-node 2 tools/convert_checkpoint.py megatron-to-hf --ckpt ./ckpt --out ./hf --tp 2
"""
import sys
from pathlib import Path

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megarlhf.cli import main  # noqa: E402

if __name__ == "__main__":  # required: the checkpoint saver spawns a multiprocessing Manager
    sys.exit(main(["convert", *sys.argv[1:]]))
