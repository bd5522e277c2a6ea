"""The tiny model and the two torchrun layouts shared by the rollout tests (each launched once):
"tp2": trainer TP=2 with one TP=1 engine per rank; "tp1": trainer TP=1 (DP=2) with one TP=2 engine."""
from __future__ import annotations

from pathlib import Path

import pytest

from megarlhf.testing.launch import read_rank_results, run_torchrun
from model_providers.tiny_models import make_tiny_model

WORKER = Path(__file__).with_name("_worker_rollout.py")
LAYOUTS = {"tp2": (2, 1), "tp1": (1, 2)}  # name -> (trainer TP, engine TP), both on 2 ranks


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """Qwen2-shaped (tied embeddings, qkv bias, GQA), so the tied-head reload path is exercised."""
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("rollout_model") / "qwen2", seed=3)


@pytest.fixture(scope="session")
def rollout_run(tiny_qwen2, tmp_path_factory):
    """``rollout_run("tp2")`` -> the two ranks' results of the rollout worker for that layout."""
    cache: dict[str, list[dict]] = {}

    def run(layout: str) -> list[dict]:
        if layout not in cache:
            trainer_tp, engine_tp = LAYOUTS[layout]
            out = tmp_path_factory.mktemp(f"rollout_{layout}")
            run_torchrun(WORKER, 2, [str(trainer_tp), str(engine_tp), str(tiny_qwen2), str(out)], timeout_s=900)
            cache[layout] = read_rank_results(out, 2)
        return cache[layout]

    return run
