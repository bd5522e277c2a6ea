"""HF -> distributed checkpoint -> HF through the real command line: tools/convert_checkpoint.py in one
process, then ``megarlhf convert`` (megarlhf/__main__.py) under torchrun with 2 ranks at PP=2, so the
checkpoint is also resharded on the way. Reference: the source HF directory, compared bit for bit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import megarlhf
from megarlhf.checkpoint import checkpoint_metadata
from megarlhf.testing.launch import run_torchrun

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "convert_checkpoint.py"
MODULE_MAIN = Path(megarlhf.__file__).with_name("__main__.py")


@pytest.mark.slow  # ~30 s of 2-rank conversions; the converters' round trips run by default in tests/model_providers
def test_hf_to_megatron_to_hf_is_bit_identical(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model_providers.tiny_models import make_tiny_model

    source = make_tiny_model("llama", tmp_path / "src", seed=11)  # 4 layers, untied head, GQA, llama3 rope
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    to_megatron = subprocess.run([sys.executable, str(TOOL), "hf-to-megatron", "--hf", str(source), "--out", str(ckpt)],
                                 capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert to_megatron.returncode == 0, to_megatron.stderr[-6000:]
    assert to_megatron.stdout.strip().endswith(f"wrote {ckpt}")
    marker = checkpoint_metadata(ckpt)
    assert marker["saved_with"]["world_size"] == 1
    assert marker["metadata"]["model_type"] == "llama" and marker["metadata"]["dtype"] == "float32"
    assert sorted(p.name for p in (ckpt / "hf").iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]

    run_torchrun(MODULE_MAIN, 2, ["convert", "megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back), "--pp", "2"],
                 timeout_s=600)
    src, got = load_file(str(source / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert src.keys() == got.keys()
    for name, tensor in src.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (back / name).read_bytes() == (source / name).read_bytes(), name
    src_config, back_config = (json.loads((d / "config.json").read_text()) for d in (source, back))
    assert {k: v for k, v in back_config.items() if k != "transformers_version"} == {
        k: v for k, v in src_config.items() if k != "transformers_version"}
    model = AutoModelForCausalLM.from_pretrained(back)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert AutoTokenizer.from_pretrained(back)("What is 3 + 4?")["input_ids"]
