"""Both rollout backends on the tiny MoE models (Qwen3-MoE, Qwen2-MoE with a shared expert, Mixtral):
greedy tokens equal transformers'; an in-place weight load (as the weight sync does it) leaves the engine's
fused expert parameters bit-identical to the sync's prediction and its log-probs equal to transformers' on
the new weights. vLLM's CPU experts were computing with stale prepacked weights after such a load (a 0.23
log-prob gap) until megarlhf re-ran their preparation (megarlhf.rollout.engines.weights.prepare_experts); with
an expert ffn size the CPU kernel pads (48 -> 64) the in-place load stopped with vLLM's bare "size of tensor a
(128) must match the size of tensor b (96)" ("qwen3_moe_ffn48")."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from model_providers.tiny_models import make_tiny_model

SCRIPT = Path(__file__).with_name("_moe_engine_check.py")


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe_engines")
    for seed, arch in enumerate(("qwen3_moe", "qwen2_moe", "mixtral")):
        make_tiny_model(arch, root / arch, seed=20 + seed)
    make_tiny_model("qwen3_moe", root / "qwen3_moe_ffn48", seed=23, moe_intermediate_size=48)
    return root


MODELS = ["qwen3_moe", "qwen2_moe", "mixtral", "qwen3_moe_ffn48"]


@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_moe_engine_generates_loads_and_verifies(moe_models, tmp_path, backend):
    proc = subprocess.run([sys.executable, str(SCRIPT), backend, str(moe_models), str(tmp_path), *MODELS],
                          capture_output=True, text=True, timeout=900, env={"OMP_NUM_THREADS": "2", **__import__("os").environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["arch"] for r in results] == MODELS
    # MoE layers x experts x 3
    experts = {"qwen3_moe": 2 * 8 * 3, "qwen2_moe": 2 * 6 * 3, "mixtral": 2 * 6 * 3, "qwen3_moe_ffn48": 2 * 8 * 3}
    for r in results:
        assert r["greedy_equal"] is True, r
        assert r["fingerprint_problems"] == [], r
        assert r["logprob_gap_after_load"] < 1e-5, r
        assert r["experts_placed"] == experts[r["arch"]], r
