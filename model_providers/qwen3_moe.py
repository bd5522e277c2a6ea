"""Qwen3-MoE (``model_type="qwen3_moe"``, e.g. Qwen3-30B-A3B): Qwen3's attention (q/k norms) with routed
experts; its config quirks.

Quirks: experts of ``moe_intermediate_size`` behind a router ``mlp.gate`` (no shared expert); the layers in
``mlp_only_layers`` (and those ``decoder_sparse_step`` skips) keep a dense SwiGLU MLP of
``intermediate_size``, stored under the dense names; ``norm_topk_prob`` chooses whether the top-k weights
are renormalised. Sliding-window attention is refused.
"""
from __future__ import annotations

from model_providers.base import PROVIDERS
from model_providers.llama import LAYER
from model_providers.moe import MoEProvider, expert_mappings, router_mapping
from model_providers.qwen2 import refuse_sliding_window_flag
from model_providers.qwen3 import QWEN3_MAPPINGS

QWEN3_MOE_MAPPINGS = QWEN3_MAPPINGS + (
    router_mapping("mlp.gate.weight"),
    *expert_mappings(LAYER + "mlp.experts.{expert}.", "gate_proj", "up_proj", "down_proj"),
)


@PROVIDERS.register("qwen3_moe")
class Qwen3MoeProvider(MoEProvider):
    model_type = "qwen3_moe"
    hf_causal_lm = "Qwen3MoeForCausalLM"
    hf_sequence_classifier = "Qwen3MoeForSequenceClassification"
    qk_layernorm = True
    body_mappings = QWEN3_MOE_MAPPINGS

    def check_supported(self) -> None:
        refuse_sliding_window_flag(self)
        super().check_supported()
