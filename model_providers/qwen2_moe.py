"""Qwen2-MoE (``model_type="qwen2_moe"``, e.g. Qwen1.5-MoE-A2.7B): Qwen2's attention (q/k/v biases) with
routed experts and a shared expert; its config quirks.

Quirks: every MoE layer also runs a shared expert of ``shared_expert_intermediate_size`` whose output is
scaled by a sigmoid gate (HF ``shared_expert_gate``, Megatron ``moe_shared_expert_gate``); dense layers
(``mlp_only_layers``, ``decoder_sparse_step``) keep the dense names; ``norm_topk_prob`` as in Qwen3-MoE.
Sliding-window attention and configs without q/k/v biases are refused.
"""
from __future__ import annotations

from model_providers.base import PROVIDERS
from model_providers.llama import LAYER
from model_providers.moe import SHARED_EXPERT_MAPPINGS, MoEProvider, expert_mappings, router_mapping
from model_providers.qwen2 import QWEN2_MAPPINGS, refuse_sliding_window_flag

QWEN2_MOE_MAPPINGS = QWEN2_MAPPINGS + (
    router_mapping("mlp.gate.weight"),
    *expert_mappings(LAYER + "mlp.experts.{expert}.", "gate_proj", "up_proj", "down_proj"),
    *SHARED_EXPERT_MAPPINGS,
)


@PROVIDERS.register("qwen2_moe")
class Qwen2MoeProvider(MoEProvider):
    model_type = "qwen2_moe"
    hf_causal_lm = "Qwen2MoeForCausalLM"
    hf_sequence_classifier = "Qwen2MoeForSequenceClassification"
    qkv_bias = True
    body_mappings = QWEN2_MOE_MAPPINGS

    def check_supported(self) -> None:
        c = self.hf_config
        refuse_sliding_window_flag(self)
        if not getattr(c, "qkv_bias", True):
            raise self._unsupported("qkv_bias=False")
        if not self.shared_expert_size:
            raise self._unsupported("shared_expert_intermediate_size=0 (a Qwen2-MoE without its shared expert)")
        super().check_supported()
