"""Mistral: Megatron logits == HF logits at TP=1, TP=2, PP=2 (multi-head attention, untied)."""
import pytest
from _parity_checks import assert_parity

from model_providers import UnsupportedModelError, get_provider
from model_providers.tiny_models import tiny_config


@pytest.mark.parametrize("layout,tp", [("tp1", 1), ("tp2", 2), pytest.param("pp2", 1, marks=pytest.mark.slow)])
def test_mistral_matches_hf(parity, layout, tp):
    assert_parity(parity(layout), "mistral", tp)


def test_mistral_sliding_window():
    with pytest.raises(UnsupportedModelError, match="sliding_window=64 < max_position_embeddings=256"):
        get_provider(tiny_config("mistral", sliding_window=64))
    # A window as long as the context never takes effect: accepted.
    assert get_provider(tiny_config("mistral", sliding_window=256)).num_query_groups == 4
