"""Llama (``model_type="llama"``): the HF <-> Megatron weight table and Llama's config quirks.

Quirks: Llama-3.x ``rope_scaling`` of type "llama3" (handled by the shared provider); attention and MLP
biases exist as config switches in HF but no released Llama uses them, so they are refused.
"""
from __future__ import annotations

from model_providers.base import PROVIDERS, ModelProvider
from model_providers.mapping import GATED_MLP, QKV, REPLICATED, ROW, VOCAB, WeightMapping

LAYER = "model.layers.{layer}."
MEGATRON_LAYER = "decoder.layers.{layer}."

LLAMA_MAPPINGS = (
    WeightMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB),
    WeightMapping(MEGATRON_LAYER + "input_layernorm.weight", (LAYER + "input_layernorm.weight",), REPLICATED),
    WeightMapping(MEGATRON_LAYER + "self_attention.linear_qkv.weight",
                  (LAYER + "self_attn.q_proj.weight", LAYER + "self_attn.k_proj.weight",
                   LAYER + "self_attn.v_proj.weight"), QKV),
    WeightMapping(MEGATRON_LAYER + "self_attention.linear_proj.weight", (LAYER + "self_attn.o_proj.weight",), ROW),
    WeightMapping(MEGATRON_LAYER + "pre_mlp_layernorm.weight", (LAYER + "post_attention_layernorm.weight",),
                  REPLICATED),
    WeightMapping(MEGATRON_LAYER + "mlp.linear_fc1.weight",
                  (LAYER + "mlp.gate_proj.weight", LAYER + "mlp.up_proj.weight"), GATED_MLP),
    WeightMapping(MEGATRON_LAYER + "mlp.linear_fc2.weight", (LAYER + "mlp.down_proj.weight",), ROW),
    WeightMapping("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED),
)


@PROVIDERS.register("llama")
class LlamaProvider(ModelProvider):
    model_type = "llama"
    hf_causal_lm = "LlamaForCausalLM"
    hf_sequence_classifier = "LlamaForSequenceClassification"
    body_mappings = LLAMA_MAPPINGS
