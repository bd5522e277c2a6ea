"""Qwen2: Megatron logits == HF logits at TP=1, TP=2, PP=2 (GQA, qkv bias, tied embeddings)."""
import pytest
from _parity_checks import assert_parity

from model_providers import UnsupportedModelError, get_provider
from model_providers.tiny_models import tiny_config


@pytest.mark.parametrize("layout,tp", [("tp1", 1), ("tp2", 2), pytest.param("pp2", 1, marks=pytest.mark.slow)])
def test_qwen2_matches_hf(parity, layout, tp):
    assert_parity(parity(layout), "qwen2", tp)


def test_qwen2_config_translation():
    provider = get_provider(tiny_config("qwen2"))
    assert provider.qkv_bias and provider.tied_embeddings
    bias = [m for m in provider.mappings() if m.megatron.endswith("linear_qkv.bias")]
    assert len(bias) == 1 and bias[0].hf[1] == "model.layers.{layer}.self_attn.k_proj.bias"
    # Tied: the last stage's output layer is loaded from the embedding and never exported twice.
    head = provider.mappings()[-1]
    assert head.hf == ("model.embed_tokens.weight",) and head.export is False
    assert "lm_head.weight" not in provider.hf_tensor_shapes()


def test_qwen2_sliding_window_refused():
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        get_provider(tiny_config("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0))
