"""Qwen3: Megatron logits == HF logits at TP=1, TP=2, PP=2 (q/k norm, explicit head_dim, GQA)."""
import pytest
from _parity_checks import assert_parity

from model_providers import get_provider
from model_providers.tiny_models import tiny_config
from megarlhf.config.parallel import ParallelConfig


@pytest.mark.parametrize("layout,tp", [("tp1", 1), ("tp2", 2), pytest.param("pp2", 1, marks=pytest.mark.slow)])
def test_qwen3_matches_hf(parity, layout, tp):
    assert_parity(parity(layout), "qwen3", tp)


def test_qwen3_config_translation():
    provider = get_provider(tiny_config("qwen3"))
    config = provider.transformer_config(ParallelConfig())
    # head_dim 32 with hidden 64 and 4 heads: kv_channels must come from head_dim, not hidden / heads.
    assert (config.kv_channels, config.hidden_size, config.num_attention_heads) == (32, 64, 4)
    assert config.qk_layernorm is True and config.add_qkv_bias is False
    names = {m.hf[0] for m in provider.mappings()}
    assert {"model.layers.{layer}.self_attn.q_norm.weight", "model.layers.{layer}.self_attn.k_norm.weight"} <= names
