"""Qwen2 (``model_type="qwen2"``): the Llama table plus q/k/v biases; its config quirks.

Quirks: q/k/v projections carry biases (Megatron ``add_qkv_bias``; the fused bias uses the same
per-query-group layout as the fused weight), the output projection does not. Small Qwen2 models tie the
LM head to the embedding (handled by the shared provider). Sliding-window attention
(``use_sliding_window``) is refused: Megatron's local attention has no window.
"""
from __future__ import annotations

from model_providers.base import PROVIDERS, ModelProvider
from model_providers.llama import LAYER, LLAMA_MAPPINGS, MEGATRON_LAYER
from model_providers.mapping import QKV, WeightMapping

QWEN2_MAPPINGS = LLAMA_MAPPINGS + (
    WeightMapping(MEGATRON_LAYER + "self_attention.linear_qkv.bias",
                  (LAYER + "self_attn.q_proj.bias", LAYER + "self_attn.k_proj.bias",
                   LAYER + "self_attn.v_proj.bias"), QKV),
)


def refuse_sliding_window_flag(provider: ModelProvider) -> None:
    """Raises if the config turns on sliding-window attention (the Qwen families' ``use_sliding_window``)."""
    if getattr(provider.hf_config, "use_sliding_window", False):
        raise provider._unsupported("use_sliding_window=True (sliding-window attention)")


@PROVIDERS.register("qwen2")
class Qwen2Provider(ModelProvider):
    model_type = "qwen2"
    hf_causal_lm = "Qwen2ForCausalLM"
    hf_sequence_classifier = "Qwen2ForSequenceClassification"
    qkv_bias = True
    body_mappings = QWEN2_MAPPINGS

    def check_supported(self) -> None:
        refuse_sliding_window_flag(self)
        super().check_supported()
