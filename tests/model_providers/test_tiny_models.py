"""Tiny models: deterministic per seed, the architecture coverage the converters need (GQA, tied and
untied, q/k norm, llama3 rope, head_dim >= 32), a working local tokenizer, and the CLI."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from model_providers.tiny_models import QWEN2_0_5B_SHAPE, TINY_CONFIGS, make_tiny_model, tiny_config

ROOT = Path(__file__).resolve().parents[2]


def test_deterministic_given_seed(tmp_path):
    a = load_file(str(make_tiny_model("qwen3", tmp_path / "a", seed=5) / "model.safetensors"))
    b = load_file(str(make_tiny_model("qwen3", tmp_path / "b", seed=5) / "model.safetensors"))
    c = load_file(str(make_tiny_model("qwen3", tmp_path / "c", seed=6) / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])
    # Norm weights are perturbed away from 1 so a mapping that drops them cannot go unnoticed.
    assert a["model.norm.weight"].std() > 0.05


def test_architecture_coverage():
    configs = {arch: tiny_config(arch) for arch in TINY_CONFIGS}
    assert sum(c.num_key_value_heads < c.num_attention_heads for c in configs.values()) >= 2
    assert {a for a, c in configs.items() if c.tie_word_embeddings} == {"qwen2"}
    assert all(c.head_dim >= 32 for c in configs.values() if getattr(c, "head_dim", None))
    assert all((getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads) >= 32  # vLLM CPU attention
               for c in configs.values())
    assert configs["qwen3"].head_dim != configs["qwen3"].hidden_size // configs["qwen3"].num_attention_heads
    assert configs["llama"].rope_parameters["rope_type"] == "llama3"
    assert all(64 <= c.hidden_size <= 128 and 2 <= c.num_hidden_layers <= 4 for c in configs.values())


def test_tokenizer_round_trip_and_chat_template(tmp_path):
    out = make_tiny_model("mistral", tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(out)
    text = "What is 12 + 7? The answer is 19."
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and len(ids) < len(text) // 2  # merges were learned
    assert len(tok) <= AutoConfig.from_pretrained(out).vocab_size
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_loaded_tokenizer_splits_as_trained(tmp_path):
    """transformers loads a qwen2 directory as Qwen2Tokenizer, which splits digits one by one whatever the
    file says; the tiny qwen2 tokenizer is trained under that split, so no learned token is dead."""
    for arch in ("llama", "qwen2"):
        out = make_tiny_model(arch, tmp_path / arch)
        tok = AutoTokenizer.from_pretrained(out)
        spaced_numbers = [t for t in tok.get_vocab() if t.startswith("\u0120") and t[1:2].isdigit()]
        ids = tok("Tom has 12 apples and 30 pears.")["input_ids"]
        pieces = [tok.decode([i]) for i in ids]
        if arch == "qwen2":
            assert type(tok).__name__ == "Qwen2Tokenizer" and not spaced_numbers
            assert pieces[pieces.index("1") - 1: pieces.index("1") + 2] == [" ", "1", "2"]
        else:
            assert spaced_numbers and " 1" in pieces  # GPT-2-style split keeps the space with the number
        assert tok.decode(ids) == "Tom has 12 apples and 30 pears."


@pytest.mark.slow  # a CLI subprocess (~11 s)
def test_cli_with_overrides(tmp_path):
    out = tmp_path / "cli"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--arch", "llama", "--out", str(out),
                    "--set", "num_hidden_layers=2", "--set", "hidden_size=64", "--set", "intermediate_size=96",
                    "--set", "num_attention_heads=2", "--set", "num_key_value_heads=1", "--dtype", "bfloat16"],
                   check=True, capture_output=True)
    config = AutoConfig.from_pretrained(out)
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (2, 64, 1)
    assert load_file(str(out / "model.safetensors"))["model.norm.weight"].dtype == torch.bfloat16


def test_qwen2_0_5b_shape_config():
    config = tiny_config("qwen2", **QWEN2_0_5B_SHAPE)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (896, 24, 14)
    assert (config.num_key_value_heads, config.intermediate_size, config.vocab_size) == (2, 4864, 151936)
    assert config.tie_word_embeddings and config.hidden_size // config.num_attention_heads == 64
