"""Shared fixtures: the tiny Llama (4 layers, GQA, untied head; vocab 384, padded to 512 at TP=2) and its
value-model twin, the single-rank worker run (vs HF transformers) and the 2-rank layout runs, each
launched once per session."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarlhf.testing.launch import read_rank_results, run_torchrun
from model_providers.tiny_models import make_tiny_model

HERE = Path(__file__).parent
LAYOUTS = {"dp2": (1, 1, 1), "tp2": (2, 1, 1), "cp2": (1, 2, 1), "pp2": (1, 1, 2)}  # (TP, CP, PP) on 2 ranks


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(causal LM dir, ...ForSequenceClassification dir with the same body and a random score head)."""
    from transformers import AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("training_models")
    make_tiny_model("llama", root / "llama", seed=0)
    rm = AutoModelForSequenceClassification.from_pretrained(root / "llama", num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        rm.score.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(100))
    rm.save_pretrained(root / "llama-rm")
    return root / "llama", root / "llama-rm"


@pytest.fixture(scope="session")
def single_run(tiny_dirs, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("training_single")
    run_torchrun(HERE / "_worker_single.py", 1, [str(tiny_dirs[0]), str(tiny_dirs[1]), str(out)], timeout_s=600)
    return read_rank_results(out, 1)[0]


@pytest.fixture(scope="session")
def layout_run(tiny_dirs, tmp_path_factory):
    """``layout_run("cp2")`` -> the two ranks' results of the layout worker (launched once per layout)."""
    cache: dict[str, list[dict]] = {}

    def run(layout: str) -> list[dict]:
        if layout not in cache:
            out = tmp_path_factory.mktemp(f"training_{layout}")
            args = [str(x) for x in LAYOUTS[layout]] + [str(tiny_dirs[0]), str(tiny_dirs[1]), str(out)]
            run_torchrun(HERE / "_worker_layouts.py", 2, args, timeout_s=600)
            cache[layout] = read_rank_results(out, 2)
        return cache[layout]

    return run
