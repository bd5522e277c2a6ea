"""Mixtral (``model_type="mixtral"``, e.g. Mixtral-8x7B): Llama's attention with routed experts in every
layer; its config quirks.

Quirks: the experts live under ``block_sparse_moe`` with the names ``w1`` (gate), ``w3`` (up) and ``w2``
(down) and ``intermediate_size`` is the expert size; the top-k weights are always renormalised; there are
no dense layers. ``router_jitter_noise`` (training-time input noise) and sliding windows shorter than the
context are refused.
"""
from __future__ import annotations

from model_providers.base import PROVIDERS
from model_providers.llama import LAYER, LLAMA_MAPPINGS
from model_providers.mistral import refuse_short_sliding_window
from model_providers.moe import MoEProvider, expert_mappings, router_mapping

MIXTRAL_MAPPINGS = tuple(m for m in LLAMA_MAPPINGS if ".mlp." not in m.megatron) + (
    router_mapping("block_sparse_moe.gate.weight"),
    *expert_mappings(LAYER + "block_sparse_moe.experts.{expert}.", "w1", "w3", "w2"),
)


@PROVIDERS.register("mixtral")
class MixtralProvider(MoEProvider):
    model_type = "mixtral"
    hf_causal_lm = "MixtralForCausalLM"
    hf_sequence_classifier = "MixtralForSequenceClassification"
    body_mappings = MIXTRAL_MAPPINGS
    num_experts_field = "num_local_experts"
    expert_ffn_field = "intermediate_size"
    always_normalised = True

    def check_supported(self) -> None:
        refuse_short_sliding_window(self)
        super().check_supported()
