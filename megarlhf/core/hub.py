"""Telling a Hugging Face hub name from a local path that does not exist, for the hint in the error.

megarlhf reads local files only. ``Qwen/Qwen2.5-0.5B`` given as ``model.path`` or ``openai/gsm8k`` as a data
path is a hub name; ``data/nope.jsonl`` (a file extension) or ``runs/x`` (``runs`` is a local directory) is
a local path with a typo, and a hub hint would mislead there.
"""
from __future__ import annotations

import re
from pathlib import Path

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FILE_EXTENSIONS = (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".tsv", ".txt", ".yaml", ".yml",
                    ".safetensors", ".bin", ".gguf", ".pt")


def looks_like_hub_name(path: str) -> bool:
    """``owner/name``, without a file extension, whose ``owner`` is not a local directory."""
    text = str(path)
    if not _HUB_NAME.match(text) or text.lower().endswith(_FILE_EXTENSIONS):
        return False
    return not Path(text.split("/")[0]).exists()
