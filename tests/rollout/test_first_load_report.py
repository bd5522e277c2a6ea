"""vLLM's first load of the checkpoint, fingerprinted while vLLM processes it
(megarlhf.rollout.engines.vllm_worker.first_load_reported), reports exactly what a reload of the same
checkpoint reports: calibration's bitwise check takes it instead of reading and loading the checkpoint a
second time. Untied and tied LM heads (vLLM processes a tied head from the embedding), qk-norms, and routed
experts whose ffn size the CPU kernel pads (48 -> 64); a second report reloads (the first load's is used once).
And nothing in a CPU engine is compiled (vllm.py's _eager_token_ranks) when it samples with log-probs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from model_providers.tiny_models import make_tiny_model

SCRIPT = Path(__file__).with_name("_first_load_check.py")
MODELS = {"llama": {}, "qwen2": {}, "qwen3": {}, "qwen3_moe": {"moe_intermediate_size": 48}}


def test_first_load_report_equals_a_reload(tmp_path):
    for seed, (arch, overrides) in enumerate(MODELS.items()):
        make_tiny_model(arch, tmp_path / arch, seed=40 + seed, **overrides)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), *MODELS], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["arch"]: r for r in map(json.loads, filter(lambda l: l.startswith("{"), proc.stdout.splitlines()))}
    assert list(results) == list(MODELS)
    for arch, r in results.items():
        assert r["problems"] == [] and r["differ"] == [] and r["equal"] is True, r
        assert r["processed"] > 0, r  # the packed linear weights, fingerprinted as processing received them
        assert r["first_s"] < 0.1, r  # taken, not reloaded
        # no torch.compile in a CPU engine: its sampler's rank count once compiled for 1.9 s at the first request
        assert r["compiled_frames"] == {}, r
