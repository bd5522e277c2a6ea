"""GGUF -> HF conversion (megarlhf/checkpoint/gguf.py), against the tiny HF models the GGUF files are
written from (the independent reference: their logits, weights and tokenizers) and gguf's own
quantizer / dequantizer; and the refusals, each naming the file and leaving nothing behind."""
from __future__ import annotations

import json
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from _gguf_writer import deinterleave_rotary, gguf_name, head_dim, write_gguf
from safetensors.torch import load_file

from megarlhf.checkpoint.gguf import (
    SUPPORTED_TENSOR_TYPES,
    GGUFError,
    gguf_to_hf,
    llama3_rope_factors,
    llama3_rope_from_factors,
)
from megarlhf.checkpoint.output_dir import MARKER_FILE
from megarlhf.core.errors import CheckpointError
from model_providers.tiny_models import make_tiny_model

TEXTS = ["What is 3 + 4? The answer is 7.", "  two spaces\n\nand blank lines\t tab ",
         "<|im_start|>user\nhi<|im_end|>\n", "Ünïcödé 日本語 🙂 1234567", ""]
# (HF architecture of the tiny source model, general.architecture llama.cpp stores it under)
CASES = {"llama": ("llama", "llama"), "qwen2": ("qwen2", "qwen2"), "qwen3": ("qwen3", "qwen3"),
         "mistral": ("mistral", "llama")}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """``sources(case)`` -> (HF dir, model, tokenizer) of a tiny random model, built once per case."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, built = tmp_path_factory.mktemp("gguf_sources"), {}

    def get(case: str):
        if case not in built:
            path = make_tiny_model(CASES[case][0], root / case, seed=len(built) + 11)
            built[case] = (path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                           AutoTokenizer.from_pretrained(path))
        return built[case]

    return get


def _leftovers(parent, name):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


@pytest.mark.parametrize("case", sorted(CASES))
def test_f32_gguf_converts_to_the_same_model(case, sources, tmp_path):
    """Logits equal the source model's; the tokenizer splits text identically and keeps the chat template;
    megarlhf's provider accepts the config. llama: Llama-3 rope scaling comes back from rope_freqs;
    qwen2: tied embeddings and q/k/v biases; qwen3: head_dim 32 != hidden/heads; mistral: stored as llama."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from model_providers import get_provider

    src_dir, src, src_tok = sources(case)
    write_gguf(tmp_path / "m.gguf", src, src_tok, gguf_arch=CASES[case][1])
    out = gguf_to_hf(tmp_path / "m.gguf", tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
            "chat_template.jinja"} <= {p.name for p in out.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([src_tok(TEXTS[0] + TEXTS[3]).input_ids])
    with torch.no_grad():
        assert (model(ids).logits - src(ids).logits).abs().max().item() <= 1e-5
    assert model.config.tie_word_embeddings == src.config.tie_word_embeddings
    assert head_dim(model.config) == head_dim(src.config)
    assert model.config.rope_parameters == src.config.rope_parameters
    tok = AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert tok(text).input_ids == src_tok(text).input_ids, text
        assert tok.decode(tok(text).input_ids) == text
    assert tok.chat_template == src_tok.chat_template and tok.eos_token == src_tok.eos_token
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert (tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == src_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    provider = get_provider(AutoConfig.from_pretrained(out))
    assert provider.hf_config.model_type == CASES[case][1]
    assert _leftovers(tmp_path, "hf") == []


def test_q8_0_weights_are_the_dequantized_bytes(sources, tmp_path):
    """Each converted matrix equals gguf's dequantization of the bytes in the file exactly (q/k un-permuted),
    and lies within the Q8_0 error of the original: per block of 32, |w - w_q| <= 0.6 * max|block| / 127
    (half a step of the int8 grid plus the fp16 rounding of the block scale: 127 * 2**-11 < 0.1 step)."""
    src_dir, src, src_tok = sources("llama")
    written = write_gguf(tmp_path / "q.gguf", src, src_tok, gguf_arch="llama", quantize=gguf.GGMLQuantizationType.Q8_0)
    out = gguf_to_hf(tmp_path / "q.gguf", tmp_path / "hf")
    converted = load_file(out / "model.safetensors")
    config = src.config
    checked = 0
    for hf_name, original in src.state_dict().items():
        name = gguf_name(hf_name)
        if original.ndim != 2:
            assert torch.equal(converted[hf_name], original), hf_name
            continue
        expected = gguf.quants.dequantize(written[name], gguf.GGMLQuantizationType.Q8_0)
        if name.endswith("attn_q.weight"):
            expected = deinterleave_rotary(expected, config.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            expected = deinterleave_rotary(expected, config.num_key_value_heads)
        assert np.array_equal(converted[hf_name].numpy(), expected), hf_name
        blocks_err = (converted[hf_name] - original).abs().reshape(-1, 32).max(dim=1).values
        bound = 0.6 * original.abs().reshape(-1, 32).max(dim=1).values / 127
        assert (blocks_err <= bound).all() and blocks_err.max() > 0, hf_name
        checked += 1
    assert checked == 2 + 7 * config.num_hidden_layers  # embedding, lm_head, 7 matrices per layer


def test_supported_types_are_exactly_what_gguf_dequantizes():
    for qtype in gguf.GGMLQuantizationType:
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        try:
            values = gguf.quants.dequantize(np.zeros((1, nbytes), dtype=np.uint8), qtype)
            works = values.shape == (1, block)
        except NotImplementedError:
            works = False
        assert works == (qtype.name in SUPPORTED_TENSOR_TYPES), qtype.name


@pytest.mark.parametrize("rope", [
    dict(rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=8192),  # Llama 3.2
    dict(rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=8192),  # Llama 3.1
    dict(rope_theta=10000.0, factor=8.0, low_freq_factor=2.0, high_freq_factor=5.0,
         original_max_position_embeddings=64)])
@pytest.mark.parametrize("dim", [64, 128])
def test_llama3_rope_factors_match_transformers_and_invert(rope, dim):
    """The divisors equal default / llama3 inverse frequencies of transformers' own rope init, and the
    parameters are recovered from them (up to the equivalent choice low_freq_factor = 1)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope, rope_type="llama3")
    config = LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, rope_parameters=params,
                         max_position_embeddings=131072)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    factors = llama3_rope_factors(params, dim)
    np.testing.assert_allclose(factors, (base / scaled).double().numpy(), rtol=1e-5)
    recovered = llama3_rope_from_factors(factors.astype(np.float32).astype(np.float64), rope["rope_theta"], dim,
                                         "x.gguf")
    np.testing.assert_allclose(llama3_rope_factors(recovered, dim), factors, rtol=1e-5)
    if rope["low_freq_factor"] == 1.0:
        assert recovered == params
    with pytest.raises(GGUFError, match="not Llama-3 rope scaling"):
        llama3_rope_from_factors(np.linspace(1.0, 3.0, dim // 2) ** 2, rope["rope_theta"], dim, "x.gguf")
    assert llama3_rope_from_factors(np.ones(dim // 2), rope["rope_theta"], dim, "x.gguf") is None


@pytest.fixture()
def llama_gguf(sources, tmp_path):
    src_dir, src, src_tok = sources("llama")
    write_gguf(tmp_path / "ok.gguf", src, src_tok, gguf_arch="llama")
    return tmp_path / "ok.gguf"


def _refused(path, out, match):
    with pytest.raises(CheckpointError, match=match) as err:
        gguf_to_hf(path, out)
    assert not out.exists() and _leftovers(out.parent, out.name) == []
    return str(err.value)


def test_truncated_and_foreign_files_are_refused(llama_gguf, tmp_path):
    data = llama_gguf.read_bytes()
    for cut in (10, 2000, len(data) - 100):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        message = _refused(tmp_path / "cut.gguf", tmp_path / "out", "truncated")
        assert "cut.gguf" in message
    (tmp_path / "model.gguf").write_text("{\"not\": \"a gguf file\"}")
    assert "model.gguf is not a GGUF file" in _refused(tmp_path / "model.gguf", tmp_path / "out", "not a GGUF file")
    _refused(tmp_path / "absent.gguf", tmp_path / "out", "absent.gguf does not exist")


def test_unsupported_architecture_is_refused(sources, tmp_path):
    src_dir, src, src_tok = sources("qwen2")
    write_gguf(tmp_path / "phi.gguf", src, src_tok, gguf_arch="phi3")
    message = _refused(tmp_path / "phi.gguf", tmp_path / "out", "architecture 'phi3'")
    assert "phi.gguf" in message and "llama, qwen2, qwen3" in message


def test_unsupported_tensor_type_and_unknown_tensors_are_refused(sources, tmp_path):
    src_dir, src, src_tok = sources("llama")
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    q8_1 = np.zeros((src.config.hidden_size, src.config.hidden_size // block * nbytes), dtype=np.uint8)
    write_gguf(tmp_path / "q81.gguf", src, src_tok, gguf_arch="llama", drop=("blk.1.attn_output.weight",),
               extra_tensors={"blk.1.attn_output.weight": (q8_1, gguf.GGMLQuantizationType.Q8_1)})
    message = _refused(tmp_path / "q81.gguf", tmp_path / "out", "tensor blk.1.attn_output.weight is stored as Q8_1")
    assert "q81.gguf" in message and "Q4_K" in message
    bias = np.zeros(src.config.hidden_size, dtype=np.float32)
    write_gguf(tmp_path / "bias.gguf", src, src_tok, gguf_arch="llama",
               extra_tensors={"blk.0.attn_q.bias": (bias, None)})
    _refused(tmp_path / "bias.gguf", tmp_path / "out", "no counterpart in a llama HF model.*blk.0.attn_q.bias")
    write_gguf(tmp_path / "short.gguf", src, src_tok, gguf_arch="llama", drop=("blk.2.ffn_up.weight",))
    _refused(tmp_path / "short.gguf", tmp_path / "out", "missing: blk.2.ffn_up.weight")


def test_overwrite_replaces_only_a_directory_fetch_wrote(llama_gguf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match=f"output {out} already exists and is not empty"):
        gguf_to_hf(llama_gguf, out)
    # --overwrite used to delete any directory (`megarlhf fetch --overwrite --out .` deleted the working one)
    with pytest.raises(CheckpointError, match=f"output {out} is not empty and was not written by megarlhf fetch"):
        gguf_to_hf(llama_gguf, out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["precious.txt"]
    shutil.rmtree(out)
    out.mkdir()  # an existing empty directory is fine
    assert gguf_to_hf(llama_gguf, out) == out and (out / "config.json").is_file()
    assert json.loads((out / MARKER_FILE).read_text())["gguf"] == str(llama_gguf)
    (out / "notes.txt").write_text("stale")
    gguf_to_hf(llama_gguf, out, overwrite=True)  # fetch's own directory is replaced whole
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").is_file()
    assert _leftovers(tmp_path, "out") == []


def test_overwrite_refuses_the_working_directory(llama_gguf, tmp_path, monkeypatch):
    out = tmp_path / "out"
    gguf_to_hf(llama_gguf, out)
    monkeypatch.chdir(out)
    with pytest.raises(CheckpointError, match=r"holds the current working directory"):
        gguf_to_hf(llama_gguf, ".", overwrite=True)
    assert (out / "model.safetensors").is_file()


def test_leftovers_of_dead_processes_are_swept(llama_gguf, tmp_path):
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    for kind in ("partial", "old"):
        (tmp_path / f".out.{kind}-{dead.pid}-0a1b").mkdir()
    (tmp_path / f".out.partial-{os.getpid()}-beef").mkdir()  # a build of a live process stays
    (tmp_path / f".other.partial-{dead.pid}-0a1b").mkdir()  # another destination's stays
    gguf_to_hf(llama_gguf, tmp_path / "out")
    assert _leftovers(tmp_path, "out") == [f".out.partial-{os.getpid()}-beef"]
    assert (tmp_path / f".other.partial-{dead.pid}-0a1b").is_dir()


def test_a_failure_while_writing_leaves_nothing(llama_gguf, tmp_path, monkeypatch):
    from megarlhf.checkpoint import gguf as converter

    def crash(header, out):
        (out / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(converter, "write_hf_directory", crash)
    with pytest.raises(OSError, match="disk full"):
        gguf_to_hf(llama_gguf, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []
