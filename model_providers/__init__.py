"""Model providers: HF config -> Megatron TransformerConfig + layer spec + GPTModel, and the declarative
HF <-> Megatron weight mappings (one small file per architecture).

``PROVIDERS`` is keyed by HF ``model_type``; every entry is a :class:`~model_providers.base.ModelProvider`
subclass called as ``provider_cls(hf_config)``. :func:`get_provider` is the one way in.
"""
from __future__ import annotations

from model_providers import (  # noqa: F401  (importing them registers them)
    llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe)
from model_providers.base import PROVIDERS, ModelProvider, UnsupportedModelError


def get_provider(hf_config) -> ModelProvider:
    """The provider for an HF config object (or a path to a model directory / config.json).

    Raises :class:`UnsupportedModelError` naming the architecture or feature megarlhf cannot reproduce.
    """
    if not hasattr(hf_config, "model_type"):
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(str(hf_config))
    model_type = hf_config.model_type
    if model_type not in PROVIDERS:
        archs = ", ".join(getattr(hf_config, "architectures", None) or []) or "unknown architecture"
        raise UnsupportedModelError(f"unsupported model_type {model_type!r} ({archs}); "
                                    f"supported: {', '.join(PROVIDERS.names())}")
    return PROVIDERS.get(model_type)(hf_config)


__all__ = ["PROVIDERS", "ModelProvider", "UnsupportedModelError", "get_provider"]
