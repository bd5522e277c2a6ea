"""Shared fixtures: the tiny HF models (built once per session) and the torchrun parity runs (one launch
per parallel layout, shared by the per-architecture test files)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarlhf.testing.launch import read_rank_results, run_torchrun
from model_providers.tiny_models import TINY_CONFIGS, TINY_MOE_CONFIGS, make_tiny_model

WORKER = Path(__file__).with_name("_worker_parity.py")
# layout -> (TP, PP, layers of the first pipeline stage; 0: even stages). "pp2-uneven": the 4-layer Llama
# splits 1 + 3, the 2-layer models 1 + 1
LAYOUTS = {"tp1": (1, 1, 0), "tp2": (2, 1, 0), "pp2": (1, 2, 0), "pp2-uneven": (1, 2, 1)}
MOE_WORKER = Path(__file__).with_name("_worker_moe_parity.py")
# MoE layout -> (TP, PP, EP, layers of the first pipeline stage): the 3-layer Qwen3-MoE splits 1 (its dense
# layer) + 2 at PP=2
MOE_LAYOUTS = {"ep1": (1, 1, 1, 0), "ep2": (1, 1, 2, 0), "tp2": (2, 1, 1, 0), "pp2": (1, 2, 1, 1),
               "ep2tp2": (2, 1, 2, 0)}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """One tiny causal LM per architecture, plus ``<arch>-rm``: the same body as a
    ``...ForSequenceClassification`` (num_labels=1) with a random ``score`` head."""
    from transformers import AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("tiny_models")
    dense = sorted(set(TINY_CONFIGS) - set(TINY_MOE_CONFIGS))
    for seed, arch in enumerate(dense + sorted(TINY_MOE_CONFIGS)):
        make_tiny_model(arch, root / arch, seed=seed)
        rm = AutoModelForSequenceClassification.from_pretrained(root / arch, num_labels=1, dtype=torch.float32)
        with torch.no_grad():
            rm.score.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(100 + seed))
        rm.save_pretrained(root / f"{arch}-rm")
    return root


@pytest.fixture(scope="session")
def parity(tiny_models, tmp_path_factory):
    """``parity("tp2")`` -> the per-rank results of the parity worker for that layout (run once)."""
    cache: dict[str, list[dict]] = {}

    def run(layout: str) -> list[dict]:
        if layout not in cache:
            tp, pp, first = LAYOUTS[layout]
            out = tmp_path_factory.mktemp(f"parity_{layout}")
            run_torchrun(WORKER, tp * pp, [str(tp), str(pp), str(tiny_models), str(out), str(first)], timeout_s=600)
            cache[layout] = read_rank_results(out, tp * pp)
        return cache[layout]

    return run


@pytest.fixture(scope="session")
def moe_parity(tiny_models, tmp_path_factory):
    """``moe_parity("ep2")`` -> the per-rank results of the MoE parity worker for that layout (run once)."""
    cache: dict[str, list[dict]] = {}

    def run(layout: str) -> list[dict]:
        if layout not in cache:
            tp, pp, ep, first = MOE_LAYOUTS[layout]
            world = max(tp * pp, tp * ep * pp)
            out = tmp_path_factory.mktemp(f"moe_parity_{layout}")
            run_torchrun(MOE_WORKER, world, [str(tp), str(pp), str(ep), str(first), str(tiny_models), str(out)],
                         timeout_s=600)
            cache[layout] = read_rank_results(out, world)
        return cache[layout]

    return run
