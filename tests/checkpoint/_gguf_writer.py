"""Writes GGUF files the way llama.cpp's converter does, from a tiny HF model, for the converter tests.

Written from the GGUF conventions (not from megarlhf's converter): tensor names ``token_embd``,
``blk.N.attn_q`` ..., ``output``; Llama's q/k rows permuted from HF's half-split rotary layout to the
interleaved one (llama.cpp does this for the ``llama`` architecture only); Llama-3 rope scaling stored as
per-frequency divisors in ``rope_freqs.weight``; the byte-level BPE tokenizer as ``tokenizer.ggml.*``
(tokens spelled in the byte alphabet, merges as "a b" strings, control tokens typed 3).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np

HF_TO_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
HF_TO_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF_GLOBAL:
        return HF_TO_GGUF_GLOBAL[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{HF_TO_GGUF_LAYER['.'.join(module)]}.{kind}"


def interleave_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotary layout (first half / second half of each head) -> llama.cpp's (pairs of neighbours)."""
    rows = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, rows, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def deinterleave_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    rows = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, rows, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def gguf_tensors(model, gguf_arch: str) -> dict[str, np.ndarray]:
    """The model's weights under their GGUF names, fp32, q/k permuted for ``llama``; no ``output`` when tied."""
    config = model.config
    tensors = {}
    for hf_name, value in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name, array = gguf_name(hf_name), value.detach().float().numpy()
        if gguf_arch == "llama" and name.endswith("attn_q.weight"):
            array = interleave_rotary(array, config.num_attention_heads)
        elif gguf_arch == "llama" and name.endswith("attn_k.weight"):
            array = interleave_rotary(array, config.num_key_value_heads)
        tensors[name] = np.ascontiguousarray(array, dtype=np.float32)
    return tensors


def llama3_rope_divisors(rope: dict, dim: int) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for Llama-3 scaling: per frequency, what the base frequency is divided by."""
    divisors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / dim)
        old, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(rope["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1.0 / ((1.0 - smooth) / rope["factor"] + smooth))
    return np.array(divisors, dtype=np.float32)


def tokenizer_tables(tokenizer, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE fast tokenizer, padded to ``vocab_size``."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    by_id = {index: token for token, index in spec["model"]["vocab"].items()}
    added = {entry["id"]: entry for entry in spec["added_tokens"]}
    tokens, types = [], []
    for index in range(vocab_size):
        if index in added:
            tokens.append(added[index]["content"])
            types.append(TOKEN_CONTROL if added[index]["special"] else TOKEN_USER_DEFINED)
        elif index in by_id:
            tokens.append(by_id[index])
            types.append(TOKEN_NORMAL)
        else:
            tokens.append(f"[PAD{index}]")
            types.append(TOKEN_UNUSED)
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    return tokens, types, merges


def write_gguf(path: Path, model, tokenizer, *, gguf_arch: str, quantize: gguf.GGMLQuantizationType | None = None,
               extra_tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]] | None = None,
               drop: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Writes ``model`` + ``tokenizer`` as a GGUF file; returns the tensors as written (bytes if quantized).

    ``quantize`` applies to the 2-D matrices (norms and biases stay F32, as llama.cpp keeps them);
    ``extra_tensors`` are written raw with the given type; ``drop`` leaves tensors out.
    """
    config = model.config
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_name("tiny test model")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(head_dim(config))
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if quantize is None else gguf.LlamaFileType.MOSTLY_Q8_0)
    written = {}
    for name, array in gguf_tensors(model, gguf_arch).items():
        if name in drop:
            continue
        if quantize is not None and array.ndim == 2:
            written[name] = gguf.quants.quantize(array, quantize)
            writer.add_tensor(name, written[name], raw_dtype=quantize)
        else:
            written[name] = array
            writer.add_tensor(name, array)
    if rope.get("rope_type") == "llama3":
        written["rope_freqs.weight"] = llama3_rope_divisors(rope, head_dim(config))
        writer.add_tensor("rope_freqs.weight", written["rope_freqs.weight"])
    for name, (array, raw_type) in (extra_tensors or {}).items():
        writer.add_tensor(name, array, raw_dtype=raw_type)
    tokens, types, merges = tokenizer_tables(tokenizer, config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    # llama.cpp names the tokenizer's pre-tokenizer split: "qwen2" (digits one by one) or GPT-2's "default"
    qwen_split = "Split" in str(tokenizer.backend_tokenizer.pre_tokenizer)
    writer.add_tokenizer_pre("qwen2" if qwen_split else "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written
