"""HF config -> Megatron ``TransformerConfig`` + layer spec + this rank's ``GPTModel`` stage.

:class:`ModelProvider` is the part every supported decoder (Llama, Qwen2, Qwen3, Mistral) shares: they
are all pre-norm RMSNorm transformers with rotary embeddings, a SwiGLU MLP and (optionally) grouped-query
attention, so one translation covers them; an architecture file adds only its quirks (qkv bias, q/k norm,
sliding-window checks) and its weight-mapping table. Anything the translation cannot represent exactly is
refused up front with an error that names the feature, rather than producing a subtly different model.

Megatron-Bridge, which has such a translation,
does not install here (Python 3.12 + Transformer Engine; see docs/PLATFORM.md).
"""
from __future__ import annotations

import importlib.util
import math
from typing import ClassVar

import torch
import torch.nn.functional as F

from megarlhf.core.errors import UserError
from megarlhf.core.registry import Registry
from model_providers.mapping import REPLICATED, VOCAB, ShardContext, WeightMapping
from parallel import cpu_compat
from megarlhf.config.parallel import LayoutError, ParallelConfig

# keyed by HF model_type; each architecture file registers its ModelProvider subclass here
PROVIDERS: Registry = Registry("model provider")

# Megatron-Core's usual padding unit: the padded vocab is a multiple of this times the TP size.
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128


class UnsupportedModelError(UserError):
    """The HF config uses an architecture or a feature megarlhf cannot reproduce exactly."""


def rope_parameters(hf_config) -> dict:
    """The config's RoPE settings as one dict (transformers 5 ``rope_parameters`` or the older fields)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    params.setdefault("rope_type", params.get("type") or "default")
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    return params


def uses_transformer_engine() -> bool:
    """Whether models are built with Transformer Engine's layer spec (a GPU with TE installed). An
    installed TE that does not import is an error, not a silent fallback to other kernels."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:
        raise RuntimeError(f"Transformer Engine is installed but 'import transformer_engine.pytorch' failed "
                           f"({type(err).__name__}: {err}); repair the install (a TE build for this torch and "
                           f"CUDA) or uninstall transformer_engine to use Megatron's local modules") from err
    return True


def shared_prefix_supported() -> bool:
    """Whether the models built here can run shared-prefix rows (:mod:`parallel.shared_prefix`): they do
    with megarlhf's local attention, not with Transformer Engine's, which does not read ``prefix_of``."""
    return not uses_transformer_engine()


def build_layer_spec(config, packed_sequences: bool = False, unfused_norms: bool = False):
    """The transformer layer spec for ``config``; the single place that chooses the modules.

    Transformer Engine's spec where TE works (GPU; TE brings its own context parallelism and packed
    attention), otherwise Megatron's local modules (CPU) with megarlhf's context-parallel attention
    swapped in when ``config.context_parallel_size > 1`` or ``packed_sequences`` (Megatron's local
    attention refuses both). ``unfused_norms`` (LoRA models): TE's spec fuses the pre-attention and
    pre-MLP norms into ``linear_qkv`` / ``linear_fc1``, whose input is then the un-normalised hidden
    state; an adapter must read the normalised one, so the norms become modules of their own
    (``input_layernorm`` / ``pre_mlp_layernorm``, the names the weight tables already use). A
    mixture-of-experts config gets Megatron's block spec instead: one layer spec per layer of this pipeline
    stage, MoE or dense as ``moe_layer_freq`` says.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    from parallel.context_parallel import with_cp_attention
    from parallel.sequence_parallel import with_sequence_parallel_norms

    if config.num_moe_experts:
        if unfused_norms:
            raise UnsupportedModelError("LoRA adapters on a mixture-of-experts model are not supported yet "
                                        "(model.lora with an MoE checkpoint)")
        # one spec per layer of this pipeline stage: MoE layers and the model's dense ones (moe_layer_freq)
        spec = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=uses_transformer_engine(),
                                                          normalization="RMSNorm")
        if uses_transformer_engine():
            return spec
        if config.sequence_parallel:  # MoE models at TP > 1 (model_providers.moe)
            spec = with_sequence_parallel_norms(spec)
        return with_cp_attention(spec, config.context_parallel_size, packed=packed_sequences)
    if uses_transformer_engine():
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
        return _with_unfused_te_norms(spec) if unfused_norms else spec
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    return with_cp_attention(spec, config.context_parallel_size, packed=packed_sequences)


# Megatron's local spec stores its separate norms under TE's fused names, so checkpoints move between specs
UNFUSED_NORM_CHECKPOINT_KEYS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _with_unfused_te_norms(spec):
    """TE's layer spec with separate norm modules before plain TE column-parallel linears (checkpoint keys
    as Megatron's local spec writes them)."""
    import dataclasses

    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm

    layer = spec.submodules
    attention, mlp = layer.self_attention, layer.mlp
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(attention.submodules,
                                                                              linear_qkv=TEColumnParallelLinear))
    mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, linear_fc1=TEColumnParallelLinear))
    layer = dataclasses.replace(layer, input_layernorm=TENorm, pre_mlp_layernorm=TENorm, self_attention=attention,
                                mlp=mlp, sharded_state_dict_keys_map=UNFUSED_NORM_CHECKPOINT_KEYS)
    return dataclasses.replace(spec, submodules=layer)


class ModelProvider:
    """One HF config turned into Megatron pieces. Subclasses: one per HF ``model_type``.

    Registry signature (``PROVIDERS``): ``provider_cls(hf_config) -> ModelProvider``.
    """

    model_type: ClassVar[str]
    hf_causal_lm: ClassVar[str]  # e.g. "LlamaForCausalLM"
    hf_sequence_classifier: ClassVar[str]  # e.g. "LlamaForSequenceClassification"
    qkv_bias: ClassVar[bool] = False
    qk_layernorm: ClassVar[bool] = False
    is_moe: ClassVar[bool] = False  # routed experts (model_providers.moe.MoEProvider)
    # The architecture's table: decoder-layer entries plus embedding and final norm (no output head).
    body_mappings: ClassVar[tuple[WeightMapping, ...]]

    def __init__(self, hf_config):
        self.hf_config = hf_config
        self.check_supported()

    # ---- what the config says -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def num_query_groups(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads

    @property
    def tied_embeddings(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", False))

    def _unsupported(self, feature: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{self.model_type} config: {feature} is not supported by megarlhf")

    def check_supported(self) -> None:
        """Refuses features the Megatron translation would silently get wrong. Subclasses extend."""
        c = self.hf_config
        if getattr(c, "hidden_act", "silu") != "silu":
            raise self._unsupported(f"hidden_act={c.hidden_act!r} (only 'silu', i.e. SwiGLU)")
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if getattr(c, key, None) and not self.is_moe:
                raise self._unsupported(f"mixture of experts ({key}={getattr(c, key)}) in a dense architecture")
        if getattr(c, "mlp_bias", False):
            raise self._unsupported("mlp_bias=True")
        if getattr(c, "attention_bias", False) and not self.qkv_bias:
            raise self._unsupported("attention_bias=True")
        rope = rope_parameters(c)
        if rope["rope_type"] not in ("default", "llama3"):
            raise self._unsupported(f"rope scaling type {rope['rope_type']!r} (supported: none, 'llama3')")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise self._unsupported(f"partial_rotary_factor={rope['partial_rotary_factor']}")
        layer_types = set(getattr(c, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise self._unsupported(f"layer types {sorted(layer_types)} (sliding-window attention in use)")

    # ---- Megatron pieces ------------------------------------------------------------------------
    def check_parallel(self, parallel: ParallelConfig) -> None:
        c, tp = self.hf_config, parallel.tensor_model_parallel_size
        if c.num_attention_heads % tp:
            raise LayoutError(f"tensor_model_parallel_size={tp} does not divide num_attention_heads="
                              f"{c.num_attention_heads} of this {self.model_type} model")
        if self.num_query_groups % tp:
            raise LayoutError(f"tensor_model_parallel_size={tp} does not divide num_key_value_heads="
                              f"{self.num_query_groups} (query groups) of this {self.model_type} model")
        if c.intermediate_size % tp:
            raise LayoutError(f"tensor_model_parallel_size={tp} does not divide intermediate_size="
                              f"{c.intermediate_size} of this {self.model_type} model")
        if parallel.expert_model_parallel_size > 1 and not self.is_moe:
            raise LayoutError(f"expert_model_parallel_size={parallel.expert_model_parallel_size} needs a "
                              f"mixture-of-experts model; this {self.model_type} model is dense")
        try:
            parallel.stage_layers(c.num_hidden_layers)
        except LayoutError as err:
            raise LayoutError(f"{err} (num_hidden_layers of this {self.model_type} model)") from None

    def transformer_config(self, parallel: ParallelConfig, params_dtype: torch.dtype = torch.float32,
                           **overrides):
        """The Megatron ``TransformerConfig`` equivalent to the HF config, for ``parallel``.

        ``overrides`` (any TransformerConfig field) win over everything, CPU settings included.
        """
        from megatron.core.transformer.transformer_config import TransformerConfig

        self.check_parallel(parallel)
        moe_settings = sorted(k for k in overrides if k.startswith("moe_"))
        if moe_settings and not self.is_moe:
            raise UnsupportedModelError(f"mixture-of-experts settings {moe_settings} (model.moe) given for this dense "
                                        f"{self.model_type} model")
        c = self.hf_config
        kwargs = dict(
            num_layers=c.num_hidden_layers,
            hidden_size=c.hidden_size,
            ffn_hidden_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads,
            num_query_groups=self.num_query_groups,
            kv_channels=self.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=c.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_layernorm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            init_method_std=getattr(c, "initializer_range", 0.02),
            params_dtype=params_dtype,
            pipeline_dtype=params_dtype,
            bf16=params_dtype == torch.bfloat16,
            fp16=params_dtype == torch.float16,
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            context_parallel_size=parallel.context_parallel_size,
            **parallel.uneven_stages,  # Megatron's layer offsets follow them (and the converters read those)
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            **(self.moe_config_fields(parallel) if self.is_moe else {}),
        )
        kwargs.update(cpu_compat.transformer_config_overrides())
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)

    def padded_vocab_size(self, tp_size: int, divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY) -> int:
        unit = divisible_by * tp_size
        return math.ceil(self.hf_config.vocab_size / unit) * unit

    def shard_context(self, tp_rank: int, tp_size: int) -> ShardContext:
        return ShardContext(tp_rank=tp_rank, tp_size=tp_size, num_attention_heads=self.hf_config.num_attention_heads,
                            num_query_groups=self.num_query_groups, head_dim=self.head_dim,
                            vocab_size=self.hf_config.vocab_size, padded_vocab_size=self.padded_vocab_size(tp_size))

    def mappings(self, head: str = "lm") -> list[WeightMapping]:
        """The full table: the architecture's body plus an output head.

        ``head``: "lm" (the causal LM head, or the last stage's copy of the tied embedding), "value"
        (a scalar head stored as HF ``score.weight``) or "none".
        """
        heads = {
            "lm": [WeightMapping("output_layer.weight", ("model.embed_tokens.weight",), VOCAB, export=False)]
            if self.tied_embeddings else [WeightMapping("output_layer.weight", ("lm_head.weight",), VOCAB)],
            "value": [WeightMapping("output_layer.weight", ("score.weight",), REPLICATED)],
            "none": [],
        }
        if head not in heads:
            raise ValueError(f"unknown head {head!r}; known: {sorted(heads)}")
        return [*self.body_mappings, *heads[head]]

    def hf_tensor_shapes(self, head: str = "lm") -> dict[str, tuple[int, ...]]:
        """Every tensor an HF checkpoint of this config holds, with its shape, read off transformers' own
        model built on the meta device (an independent statement of the HF layout), through transformers'
        own save-time conversion (MoE experts are fused in memory, stored per expert on disk)."""
        cache = self.__dict__.setdefault("_hf_shapes", {})
        if head not in cache:
            from transformers import AutoModelForCausalLM
            from transformers.core_model_loading import revert_weight_conversion

            with torch.device("meta"):
                hf_model = AutoModelForCausalLM.from_config(self.hf_config)
            on_disk = revert_weight_conversion(hf_model, hf_model.state_dict())
            shapes = {name: tuple(t.shape) for name, t in on_disk.items()}
            if head != "lm" or self.tied_embeddings:
                shapes.pop("lm_head.weight", None)
            if head == "value":
                shapes["score.weight"] = (1, self.hf_config.hidden_size)
            cache[head] = shapes
        return cache[head]

    def build_model(self, params_dtype: torch.dtype = torch.float32, *, tie_embeddings: bool | None = None,
                    packed_sequences: bool = False, unfused_norms: bool = False, **config_overrides):
        """This rank's pipeline stage of the ``GPTModel`` (randomly initialised; load weights after).

        Megatron's parallel state must be initialised (``parallel.runtime.init_parallel``).
        ``tie_embeddings=False`` overrides the config (value models never tie their head).
        ``packed_sequences=True`` builds attention that accepts packed (``cu_seqlens``) micro-batches;
        ``unfused_norms=True`` keeps norms out of the linear layers (LoRA; :func:`build_layer_spec`).
        """
        from model_providers.gpt_model import TokenPositionGPTModel
        from parallel.runtime import current_layout, model_groups

        parallel, pp = current_layout(), model_groups().pp
        config = self.transformer_config(parallel, params_dtype, **config_overrides)
        rope = rope_parameters(self.hf_config)
        model = TokenPositionGPTModel(  # GPTModel, plus per-token RoPE positions for shared-prefix rows
            config=config,
            transformer_layer_spec=build_layer_spec(config, packed_sequences, unfused_norms),
            vocab_size=self.padded_vocab_size(parallel.tensor_model_parallel_size),
            max_sequence_length=self.hf_config.max_position_embeddings,
            pre_process=pp.rank == 0,
            post_process=pp.rank == pp.size - 1,
            share_embeddings_and_output_weights=self.tied_embeddings if tie_embeddings is None else tie_embeddings,
            position_embedding_type="rope",
            rotary_base=rope["rope_theta"],
        )
        if rope["rope_type"] == "llama3":
            self._apply_llama3_rope_scaling(model, rope)
        # Megatron's local spec builds its norms with torch defaults (fp32, host); give every parameter
        # the model's dtype and device, as Transformer Engine modules and Float16Module would.
        model.to(dtype=params_dtype)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        return model

    @staticmethod
    def _apply_llama3_rope_scaling(model, rope: dict) -> None:
        """Llama-3 frequency scaling with all four of the config's parameters.

        GPTModel's ``rope_scaling=True`` fixes low/high frequency factors at 1/4 and the original context
        at 8192; real configs may differ, so the same Megatron routine is applied with the config's values.
        """
        emb = model.rotary_pos_emb
        emb.inv_freq = emb._apply_scaling(
            emb.inv_freq, factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            original_max_position_embeddings=rope["original_max_position_embeddings"])
