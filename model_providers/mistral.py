"""Mistral (``model_type="mistral"``): the Llama table; its config quirk is the sliding window.

Mistral-7B-v0.1 configs set ``sliding_window`` (4096) below the context length, so attention past the
window differs from full causal attention; Megatron's local attention has no window, so such configs are
refused. Later Mistral releases set ``sliding_window: null`` and load as plain full attention; a window at
least as long as ``max_position_embeddings`` never takes effect and is accepted too.
"""
from __future__ import annotations

from model_providers.base import PROVIDERS, ModelProvider
from model_providers.llama import LLAMA_MAPPINGS


def refuse_short_sliding_window(provider: ModelProvider) -> None:
    """Raises if the config's ``sliding_window`` is shorter than its context (Mistral's and Mixtral's field)."""
    window = getattr(provider.hf_config, "sliding_window", None)
    if window is not None and window < provider.hf_config.max_position_embeddings:
        raise provider._unsupported(
            f"sliding_window={window} < max_position_embeddings={provider.hf_config.max_position_embeddings} "
            "(sliding-window attention in use)")


@PROVIDERS.register("mistral")
class MistralProvider(ModelProvider):
    model_type = "mistral"
    hf_causal_lm = "MistralForCausalLM"
    hf_sequence_classifier = "MistralForSequenceClassification"
    body_mappings = LLAMA_MAPPINGS

    def check_supported(self) -> None:
        refuse_short_sliding_window(self)
        super().check_supported()
