"""Qwen3 (``model_type="qwen3"``): the Llama table plus per-head q/k RMSNorms; its config quirks.

Quirks: an RMSNorm over each head's query and key (HF ``q_norm``/``k_norm``, Megatron ``qk_layernorm``,
one weight of size head_dim shared by all heads, so replicated over TP ranks); ``head_dim`` is set
explicitly and need not equal hidden_size / num_attention_heads. No biases. Sliding-window attention is
refused.
"""
from __future__ import annotations

from model_providers.base import PROVIDERS, ModelProvider
from model_providers.llama import LAYER, LLAMA_MAPPINGS, MEGATRON_LAYER
from model_providers.mapping import REPLICATED, WeightMapping
from model_providers.qwen2 import refuse_sliding_window_flag

QWEN3_MAPPINGS = LLAMA_MAPPINGS + (
    WeightMapping(MEGATRON_LAYER + "self_attention.q_layernorm.weight", (LAYER + "self_attn.q_norm.weight",),
                  REPLICATED),
    WeightMapping(MEGATRON_LAYER + "self_attention.k_layernorm.weight", (LAYER + "self_attn.k_norm.weight",),
                  REPLICATED),
)


@PROVIDERS.register("qwen3")
class Qwen3Provider(ModelProvider):
    model_type = "qwen3"
    hf_causal_lm = "Qwen3ForCausalLM"
    hf_sequence_classifier = "Qwen3ForSequenceClassification"
    qk_layernorm = True
    body_mappings = QWEN3_MAPPINGS

    def check_supported(self) -> None:
        refuse_sliding_window_flag(self)
        super().check_supported()
