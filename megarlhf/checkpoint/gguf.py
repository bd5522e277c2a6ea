"""A GGUF file (llama.cpp's single-file checkpoint) -> an HF model directory megarlhf can train.

:func:`gguf_to_hf` checks the file's header first (with ``gguf.GGUFReader``), then lets transformers
dequantize it (``from_pretrained(..., gguf_file=...)``, fp32) and writes an ordinary HF directory:
safetensors weights, config.json, generation_config.json, the tokenizer files and the chat template.
The directory is built in a temporary sibling and renamed into place at the end, so an error or a crash
never leaves a half-written ``out_dir``.

What is supported, and why exactly that:

* Architectures (``general.architecture``): ``llama``, ``qwen2``, ``qwen3``: the ones both transformers
  5.19's GGUF loader and megarlhf's model providers handle. Mistral models are stored by llama.cpp under
  ``llama`` (there is no ``mistral`` architecture in gguf-py, and transformers cannot load a file that
  says ``mistral``) and convert as Llama, which they are (a Mistral with a sliding window aside).
* Tensor types: those ``gguf.quants.dequantize`` (gguf 0.19, which transformers calls for these
  architectures) implements: :data:`SUPPORTED_TENSOR_TYPES`. Not Q8_1, Q8_K (llama.cpp's internal
  activation formats), the integer types or F64.
* Tokenizers: ``tokenizer.ggml.model`` ``gpt2`` (byte-level BPE: Llama 3, SmolLM, Qwen) or ``llama``
  (SentencePiece: Llama 2, Mistral, TinyLlama), the two transformers rebuilds for these architectures
  (this project's tests write and check byte-level BPE files; the SentencePiece path is transformers').
  The saved tokenizer is reloaded and must split a probe text exactly as the file's tokenizer does.

transformers' GGUF loader alone is lenient in ways that silently give a different model, so
the header is checked here and what the loader misses is supplied: it ignores ``attention.key_length``
(a Qwen3 whose head_dim is not hidden/heads loads with the wrong shapes and no error), drops
``rope_freqs.weight`` (Llama-3.x rope scaling, which llama.cpp stores as per-frequency factors: it is
rebuilt here into ``rope_parameters`` and checked against the factors), skips tensors it has no name for
and refuses ``save_pretrained`` while the GGUF quantization record is on the config.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megarlhf.checkpoint.output_dir import MARKER_FILE, atomic_output_dir
from megarlhf.core.errors import CheckpointError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                          "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                          "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4")
SUPPORTED_TOKENIZERS = ("gpt2", "llama")

_LAYER_TENSORS = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                  "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_ARCH_LAYER_TENSORS = {"llama": (), "qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
                       "qwen3": ("attn_q_norm.weight", "attn_k_norm.weight")}
_OPTIONAL_TENSORS = {"llama": ("output.weight", "rope_freqs.weight"), "qwen2": ("output.weight",),
                     "qwen3": ("output.weight",)}
_GGUF_MAGIC = b"GGUF"
_TOKENIZER_PROBE = ("What is 12 + 345? It's 357.\n\n  Two  spaces,\ttabs; ÜNÏCÖDÉ 日本語 🙂 <|im_start|>user\n"
                    "hi<|im_end|> don't  x=3.14159e-2 (a*b)/c_d  \r\n end")


class GGUFError(CheckpointError):
    """A GGUF file that cannot be converted; the message names the file and what is wrong."""


@dataclass(frozen=True)
class GGUFHeader:
    """What the converter needs from a GGUF file: its scalar metadata (arrays as their length), each
    tensor's type name and shape (torch order) and, when present, the rope frequency factors."""

    path: Path
    metadata: dict[str, object]
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    rope_freqs: np.ndarray | None

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default=None):
        """The architecture-scoped metadata ``<arch>.<key>``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def read_gguf_header(gguf_path: str | os.PathLike) -> GGUFHeader:
    """Reads a GGUF file's header; raises :class:`GGUFError` for a missing, non-GGUF or truncated file."""
    import gguf

    path = Path(gguf_path)
    if not path.exists():
        raise GGUFError(f"GGUF file {path} does not exist")
    if not path.is_file():
        raise GGUFError(f"{path} is not a file (a GGUF file was expected)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file: it starts with {magic!r}, a GGUF file with {_GGUF_MAGIC!r}")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as err:  # noqa: BLE001 -- whatever numpy raises on a cut or garbled file
        raise GGUFError(f"{path} is truncated or corrupt: its header cannot be read ({err})") from None
    size = path.stat().st_size
    tensors, rope_freqs = {}, None
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size or tensor.data.nbytes != tensor.n_bytes:
            raise GGUFError(f"{path} is truncated: tensor {tensor.name} ends at byte "
                            f"{tensor.data_offset + tensor.n_bytes}, the file has {size}")
        shape = tuple(int(d) for d in reversed(tensor.shape))
        tensors[tensor.name] = (tensor.tensor_type.name, shape)
        if tensor.name == "rope_freqs.weight" and tensor.tensor_type.name in SUPPORTED_TENSOR_TYPES:
            rope_freqs = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                                    dtype=np.float64).reshape(-1)
    metadata = {}
    for key, field in reader.fields.items():
        is_array = field.types and field.types[0] == gguf.GGUFValueType.ARRAY
        metadata[key] = len(field.data) if is_array else field.contents()
    return GGUFHeader(path, metadata, tensors, rope_freqs)


def check_convertible(header: GGUFHeader) -> None:
    """Raises :class:`GGUFError` naming the first reason the file cannot become a faithful HF model."""
    where = header.path
    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{where}: architecture {arch!r} (general.architecture) is not supported; supported: "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)} (Mistral models are stored as 'llama')")
    for key in ("block_count", "embedding_length", "attention.head_count"):
        value = header.arch_value(key)
        if not isinstance(value, int) or value < 1:
            raise GGUFError(f"{where}: {arch}.{key} is missing or invalid ({value!r})")
    if header.arch_value("expert_count", 0):
        raise GGUFError(f"{where}: a mixture-of-experts model ({arch}.expert_count="
                        f"{header.arch_value('expert_count')}) is not supported")
    scaling = header.arch_value("rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(f"{where}: rope scaling {scaling!r} ({arch}.rope.scaling.type) is not supported "
                        "(supported: none, and Llama-3 scaling stored as rope_freqs.weight)")
    for name, (type_name, _) in header.tensors.items():
        if type_name not in SUPPORTED_TENSOR_TYPES:
            raise GGUFError(f"{where}: tensor {name} is stored as {type_name}, which cannot be dequantized; "
                            f"supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}")
    _check_tensor_names(header)
    tokenizer = header.metadata.get("tokenizer.ggml.model")
    if tokenizer is None:
        raise GGUFError(f"{where} has no tokenizer (no tokenizer.ggml.model in its metadata)")
    if tokenizer not in SUPPORTED_TOKENIZERS:
        raise GGUFError(f"{where}: tokenizer type {tokenizer!r} (tokenizer.ggml.model) is not supported; "
                        f"supported: {', '.join(SUPPORTED_TOKENIZERS)}")


def _check_tensor_names(header: GGUFHeader) -> None:
    """Every tensor the architecture needs is present, and nothing the HF model would silently drop."""
    arch, layers = header.architecture, header.arch_value("block_count")
    per_layer = _LAYER_TENSORS + _ARCH_LAYER_TENSORS[arch]
    required = {"token_embd.weight", "output_norm.weight"} | {f"blk.{i}.{t}" for i in range(layers) for t in per_layer}
    present = set(header.tensors)
    missing = sorted(required - present)
    if missing:
        raise GGUFError(f"{header.path}: {len(missing)} tensor(s) a {arch} model needs are missing: "
                        f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(present - required - set(_OPTIONAL_TENSORS[arch]))
    if unexpected:
        raise GGUFError(f"{header.path}: tensor(s) with no counterpart in a {arch} HF model (converting would "
                        f"drop them): {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")


def hf_config_overrides(header: GGUFHeader) -> dict:
    """Config fields transformers' GGUF loader does not read from this file: ``head_dim`` and the Llama-3
    ``rope_parameters`` (rebuilt from ``rope_freqs.weight``)."""
    arch = header.architecture
    hidden, heads = header.arch_value("embedding_length"), header.arch_value("attention.head_count")
    head_dim = header.arch_value("attention.key_length") or header.arch_value("rope.dimension_count")
    head_dim = head_dim or hidden // heads
    for key in ("attention.value_length", "rope.dimension_count"):
        value = header.arch_value(key)
        if value is not None and value != head_dim:
            raise GGUFError(f"{header.path}: {arch}.{key}={value} differs from the head size {head_dim} "
                            "(partial rotary embeddings / different value heads are not supported)")
    overrides = {}
    if arch == "qwen2" and head_dim != hidden // heads:
        raise GGUFError(f"{header.path}: a qwen2 head size {head_dim} != hidden/heads = {hidden // heads} "
                        "is not supported")
    if arch in ("llama", "qwen3"):
        overrides["head_dim"] = head_dim
    if header.rope_freqs is not None:
        theta = float(header.arch_value("rope.freq_base", 10000.0))
        rope = llama3_rope_from_factors(header.rope_freqs, theta, head_dim, header.path)
        if rope is not None:
            overrides["rope_parameters"] = rope
    return overrides


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama-3 rope scaling (what llama.cpp stores as ``rope_freqs.weight``)."""
    inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    smooth = (old / wavelen - low) / (high - low)
    medium = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, medium))


def llama3_rope_from_factors(factors: np.ndarray, theta: float, head_dim: int, where: Path) -> dict | None:
    """The Llama-3 ``rope_parameters`` whose factors are ``factors`` (None if all are 1: no scaling).

    In the smooth band ``1/f = (1 - s)/factor + s`` with ``s = A/wavelen - B``, ``A = original/(high-low)``,
    ``B = low/(high-low)``; fitting A, B fixes the factors for every frequency, and ``low = 1`` picks one of
    the equivalent parameter sets (Meta's). With fewer than two smooth points Meta's ``low=1, high=4`` are
    assumed. Whatever is found is accepted only if it reproduces every factor of the file.
    """
    n = head_dim // 2
    if factors.shape != (n,):
        raise GGUFError(f"{where}: rope_freqs.weight has {factors.size} values, the head size {head_dim} needs {n}")
    if np.allclose(factors, 1.0, rtol=0, atol=1e-7):
        return None
    factor = float(factors.max())
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
    band = (factors > 1.0 + 1e-6) & (factors < factor * (1.0 - 1e-6))
    low, high, original = 1.0, 4.0, 8192.0  # Meta's Llama 3.x values; llama.cpp's default original length
    if band.sum() >= 2:
        a, minus_b = np.polyfit(1.0 / wavelen[band], smooth[band], 1)
        if -minus_b > 0:
            low, high, original = 1.0, 1.0 - 1.0 / minus_b, a / -minus_b
    elif band.sum() == 1:
        original = float(wavelen[band][0] * ((high - low) * smooth[band][0] + low))
    rope = dict(rope_type="llama3", rope_theta=theta, factor=round(factor, 6), low_freq_factor=round(low, 6),
                high_freq_factor=round(high, 6), original_max_position_embeddings=int(round(original)))
    if not np.allclose(llama3_rope_factors(rope, head_dim), factors, rtol=1e-5, atol=0):
        raise GGUFError(f"{where}: rope_freqs.weight is not Llama-3 rope scaling (no factor/low/high/original "
                        "context length reproduces it), so it cannot be expressed as an HF rope_parameters")
    return rope


def write_hf_directory(header: GGUFHeader, out: Path) -> None:
    """Loads the checked file with transformers (fp32, dequantized) and saves it as an HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(header.path.parent), header.path.name
    overrides = hf_config_overrides(header)  # config fields, applied when transformers builds the config
    try:
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32, **overrides)
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    except (ValueError, KeyError, NotImplementedError, RuntimeError) as err:
        raise GGUFError(f"{header.path}: transformers could not load it: {type(err).__name__}: {err}") from None
    _check_loaded(model, header)
    if len(tokenizer) > model.config.vocab_size:
        raise GGUFError(f"{header.path}: the tokenizer has {len(tokenizer)} tokens, the model's vocabulary "
                        f"{model.config.vocab_size}")
    # save_pretrained refuses a model that still carries the GGUF quantizer; the weights are plain fp32.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    _save_tokenizer(tokenizer, out, header.path)


def _save_tokenizer(tokenizer, out: Path, where: Path) -> None:
    """Saves the tokenizer so that it loads back splitting text as the file's tokenizer does.

    transformers rebuilds some tokenizer classes (Qwen2Tokenizer) with a pre-tokenizer of their own on
    load, whatever tokenizer.json says; when that changes the tokens, the directory names the generic
    class instead, which takes tokenizer.json as written."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(out)
    probe = [_TOKENIZER_PROBE, tokenizer.decode(list(range(min(len(tokenizer), 4096))))]
    expected = [tokenizer(text).input_ids for text in probe]
    for attempt in range(2):
        if [AutoTokenizer.from_pretrained(out)(text).input_ids for text in probe] == expected:
            return
        config_path = out / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["tokenizer_class"] = "TokenizersBackend"
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    raise GGUFError(f"{where}: the converted tokenizer does not load back as the file's tokenizer")


def _check_loaded(model, header: GGUFHeader) -> None:
    """Every parameter has the shape the config implies (the loader installs whatever shape the file has)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        expected = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).state_dict()
    loaded = model.state_dict()
    if set(loaded) != set(expected):
        raise GGUFError(f"{header.path}: the loaded model's parameters differ from the config's: "
                        f"{sorted(set(loaded) ^ set(expected))[:5]}")
    for key, value in expected.items():
        if loaded[key].shape != value.shape or loaded[key].dtype != torch.float32:
            raise GGUFError(f"{header.path}: {key} loads as {tuple(loaded[key].shape)} {loaded[key].dtype}, "
                            f"the config implies {tuple(value.shape)} float32")


def gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Converts a GGUF file of a supported architecture into an HF directory at ``out_dir`` (fp32 weights,
    tokenizer, chat template). Refuses, naming the file and the reason, anything it cannot convert
    faithfully, and a non-empty ``out_dir`` unless ``overwrite``. Returns the output path."""
    header = read_gguf_header(gguf_path)
    check_convertible(header)
    with atomic_output_dir(out_dir, overwrite) as build:
        write_hf_directory(header, build)
        marker = {"gguf": str(header.path.absolute()), "bytes": header.path.stat().st_size}
        (build / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return Path(out_dir).absolute()
