"""A model's shape without its weights: read from an HF ``config.json`` or a named public preset.

The memory planner needs only the architecture numbers (hidden size, layers, heads, vocabulary, ...).
:func:`resolve_shape` finds them in this order: an explicit ``--arch`` (a preset name or a path to a
``config.json`` / model directory), ``<model.path>/config.json`` when the checkpoint is present, or a
preset whose name is the last component of ``model.path`` (so a recipe pointing at
``checkpoints/Qwen2.5-7B-Instruct`` plans without the checkpoint being downloaded).

The presets are the public ``config.json`` values of the models the shipped recipes name; their
parameter counts (tests/planner) match the published totals. :meth:`ModelShape.params_per_rank` counts
one rank's parameters the way Megatron-Core shards them: column/row-parallel attention and MLP split over
TP, norms replicated, the vocabulary padded to a multiple of 128 x TP and split over TP, layers split
over PP, the embedding on the first stage and the output layer on the last. A mixture-of-experts model's
MoE layers hold a router (replicated), ``num_experts / EP`` routed experts split over the expert
tensor-parallel size (= TP) and, in Qwen2-MoE, a shared expert split over TP with its gate;
:meth:`ModelShape.expert_params_per_rank` is the routed experts' part (their gradients and optimizer state
are reduced and sharded over the expert-data-parallel ranks, not the dense ones).

No library computes Megatron's per-rank sharding from an HF config without building it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from model_providers.base import MAKE_VOCAB_SIZE_DIVISIBLE_BY

from megarlhf.core.errors import ConfigError, UserError
from megarlhf.config.parallel import LayoutError, ParallelConfig


_QWEN25_COMMON = dict(model_type="qwen2", vocab_size=151936, max_position_embeddings=32768)
PRESETS: dict[str, dict] = {
    "Qwen2.5-0.5B": dict(_QWEN25_COMMON, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(_QWEN25_COMMON, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(_QWEN25_COMMON, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       tie_word_embeddings=False),
    "Llama-3.1-8B": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         tie_word_embeddings=False, max_position_embeddings=131072),
    # what `megarlhf fetch smollm2-135m-instruct` writes (the shipped SmolLM2 recipes plan before the fetch)
    "SmolLM2-135M": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    "Qwen3-30B-A3B": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
                          tie_word_embeddings=False, max_position_embeddings=40960),
}
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")


def preset_for(name: str) -> dict | None:
    """The preset named ``name`` (case-insensitive; an ``-Instruct`` suffix and an ``owner/`` prefix are
    ignored: the instruct models share the base architecture)."""
    key = name.rsplit("/", 1)[-1].lower().removesuffix("-instruct")
    for preset, values in PRESETS.items():
        if preset.lower() == key:
            return values
    return None


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a dense decoder-only model (Llama / Qwen2 / Qwen3 / Mistral family)."""

    name: str
    hidden_size: int
    ffn_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    # mixture of experts (0 / empty for a dense model): routed experts, experts per token, one expert's FFN
    # size, the shared expert's FFN size, and 1 for each MoE layer (0: a dense layer)
    num_experts: int = 0
    top_k: int = 0
    expert_ffn_size: int = 0
    shared_expert_size: int = 0
    moe_pattern: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, config: dict, name: str) -> "ModelShape":
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size") if k not in config]
        if missing:
            raise UserError(f"{name}: the model config lacks {missing} (not a decoder-only LM config?)")
        heads = config["num_attention_heads"]
        return cls(**_moe_fields(config), name=name, hidden_size=config["hidden_size"], ffn_size=config["intermediate_size"],
                   num_layers=config["num_hidden_layers"], num_heads=heads,
                   num_kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   vocab_size=config["vocab_size"], tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                   qkv_bias=config.get("model_type") in ("qwen2", "qwen2_moe") or bool(config.get("attention_bias", False)),
                   qk_norm=config.get("model_type") in ("qwen3", "qwen3_moe"))

    def padded_vocab(self, tp: int) -> int:
        unit = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp
        return math.ceil(self.vocab_size / unit) * unit

    def check_layout(self, tp: int, pp: int, ep: int = 1, **uneven_stages: int) -> list[int]:
        """Raises unless TP divides the heads and the FFN, EP the experts, and the layers split over the PP
        stages (``uneven_stages``: :class:`megarlhf.config.parallel.ParallelConfig`'s first / last stage counts);
        returns each stage's layer count. The same rules as ``model_providers`` ``check_parallel``."""
        if self.num_heads % tp or self.num_kv_heads % tp or self.ffn_size % tp:
            raise ConfigError(f"tensor_model_parallel_size={tp} does not divide the {self.num_heads} attention "
                              f"heads, {self.num_kv_heads} KV heads and FFN size {self.ffn_size} of {self.name}")
        if ep > 1 and not self.num_experts:
            raise ConfigError(f"expert_model_parallel_size={ep} needs a mixture-of-experts model; {self.name} is dense")
        if self.num_experts and (self.num_experts % ep or self.expert_ffn_size % tp or self.shared_expert_size % tp):
            raise ConfigError(f"expert_model_parallel_size={ep} / tensor_model_parallel_size={tp} do not divide the "
                              f"{self.num_experts} experts / expert FFN size {self.expert_ffn_size} (shared "
                              f"{self.shared_expert_size}) of {self.name}")
        try:
            return ParallelConfig(1, pp, 1, **uneven_stages).stage_layers(self.num_layers)
        except LayoutError as err:
            raise ConfigError(f"{err} ({self.name})") from None

    def layer_params(self, tp: int, moe: bool = False, ep: int = 1) -> int:
        """One transformer layer's parameters on one TP rank (``moe``: an MoE layer on one EP rank)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim // tp, self.num_kv_heads * self.head_dim // tp
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        if not moe:
            return attn + 3 * h * self.ffn_size // tp + norms
        shared = 3 * h * self.shared_expert_size // tp + h if self.shared_expert_size else 0
        return attn + norms + self.num_experts * h + shared + self.routed_expert_params(tp, ep)

    def routed_expert_params(self, tp: int, ep: int) -> int:
        """One MoE layer's routed experts on one rank: ``num_experts / EP`` experts split over TP."""
        return self.num_experts // ep * 3 * self.hidden_size * self.expert_ffn_size // tp

    def stage_moe_layers(self, tp: int, pp: int, stage: int, **uneven_stages: int) -> tuple[int, int]:
        """(dense layers, MoE layers) of pipeline stage ``stage``."""
        counts = self.check_layout(tp, pp, **uneven_stages)
        start = sum(counts[:stage])
        moe = sum(self.moe_pattern[start:start + counts[stage]]) if self.moe_pattern else 0
        return counts[stage] - moe, moe

    def expert_params_per_rank(self, tp: int, pp: int, stage: int, ep: int = 1, **uneven_stages: int) -> int:
        """The routed experts' parameters of one rank of ``stage`` (part of :meth:`params_per_rank`)."""
        return self.stage_moe_layers(tp, pp, stage, **uneven_stages)[1] * self.routed_expert_params(tp, ep)

    def lora_layer_params(self, rank: int, targets, tp: int, canonical: bool = False) -> int:
        """One layer's LoRA factors on one TP rank (parallel.lora: column layers hold A whole and B split,
        row layers A split and B whole; ``canonical``: an A per projection of the fused q/k/v and gate/up)."""
        h, f = self.hidden_size, self.ffn_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv_a, fc1_a = (3, 2) if canonical else (1, 1)
        per_target = {"linear_qkv": qkv_a * rank * h + (q + 2 * kv) // tp * rank,
                      "linear_proj": rank * q // tp + h * rank,
                      "linear_fc1": fc1_a * rank * h + 2 * f // tp * rank, "linear_fc2": rank * f // tp + h * rank}
        return sum(per_target[t] for t in targets)

    def params_per_rank(self, tp: int, pp: int, stage: int, head: str = "lm", ep: int = 1, **uneven_stages: int) -> int:
        """Parameters of one rank of pipeline stage ``stage``; ``head``: "lm" or "value" (critic)."""
        h = self.hidden_size
        self.check_layout(tp, pp, ep, **uneven_stages)
        dense, moe = self.stage_moe_layers(tp, pp, stage, **uneven_stages)
        total = dense * self.layer_params(tp) + moe * self.layer_params(tp, moe=True, ep=ep)
        embedding = self.padded_vocab(tp) // tp * h
        if stage == 0:
            total += embedding
        if stage == pp - 1:
            total += h  # final norm
            if head == "value":
                total += h
            elif not self.tied_embeddings or pp > 1:  # a tied head on a later stage keeps its own copy
                total += embedding
        return total

    def total_params(self) -> int:
        """The HF checkpoint's parameter count (unpadded vocabulary, tied head counted once)."""
        embedding = self.vocab_size * self.hidden_size
        moe = sum(self.moe_pattern)
        return ((self.num_layers - moe) * self.layer_params(1) + moe * self.layer_params(1, moe=True)
                + self.hidden_size + embedding + (0 if self.tied_embeddings else embedding))

    def largest_tensor(self) -> int:
        """Elements of the largest HF tensor (what one weight-sync message holds at least)."""
        return max(self.vocab_size * self.hidden_size, self.hidden_size * max(self.ffn_size, self.expert_ffn_size))

    def kv_elements_per_token(self) -> int:
        """K and V elements per token over all layers (the vLLM KV cache's unit)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _moe_fields(config: dict) -> dict:
    """The mixture-of-experts fields of an HF config (model_providers.moe reads the same ones); {} if dense."""
    # the hub's Qwen MoE configs write num_experts, transformers 5 saves it as num_local_experts (Mixtral's name)
    experts = config.get("num_experts") or config.get("num_local_experts")
    if config.get("model_type") not in MOE_MODEL_TYPES or not experts:
        return {}
    mixtral = config["model_type"] == "mixtral"
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    return dict(num_experts=experts, top_k=config["num_experts_per_tok"],
                expert_ffn_size=config["intermediate_size"] if mixtral else config["moe_intermediate_size"],
                shared_expert_size=int(config.get("shared_expert_intermediate_size") or 0),
                moe_pattern=tuple(0 if i in dense or (i + 1) % step else 1 for i in range(config["num_hidden_layers"])))


def _read_config(path: Path) -> dict:
    file = path / "config.json" if path.is_dir() else path
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{file}: not valid JSON ({exc.msg}, line {exc.lineno})") from None


def resolve_shape(model_path: str, arch: str | None = None) -> tuple[ModelShape, str]:
    """The shape to plan with and a note saying where it came from."""
    if arch:
        preset = preset_for(arch)
        if preset is not None:
            return ModelShape.from_hf_config(preset, arch), f"preset {arch}"
        path = Path(arch)
        if not path.exists():
            raise UserError(f"--arch {arch!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
                            f"config.json / model directory")
        return ModelShape.from_hf_config(_read_config(path), str(path)), f"{path}"
    path = Path(model_path)
    if (path / "config.json").is_file():
        return ModelShape.from_hf_config(_read_config(path), path.name), f"{path / 'config.json'}"
    preset = preset_for(path.name)
    if preset is not None:
        return (ModelShape.from_hf_config(preset, path.name),
                f"preset {path.name} (no checkpoint at model.path={model_path!r}; public architecture values)")
    raise UserError(f"model.path={model_path!r} has no config.json and its name matches no preset "
                    f"({', '.join(PRESETS)}): pass --arch PRESET or --arch path/to/config.json")
