"""Llama: Megatron logits == HF logits at TP=1, TP=2, PP=2; exact round trip; Llama-3 rope scaling."""
import pytest
from _parity_checks import arch_results, assert_parity

from model_providers import get_provider
from model_providers.llama import LlamaProvider
from model_providers.tiny_models import tiny_config


@pytest.mark.parametrize("layout,tp", [("tp1", 1), ("tp2", 2), pytest.param("pp2", 1, marks=pytest.mark.slow)])
def test_llama_matches_hf(parity, layout, tp):
    assert_parity(parity(layout), "llama", tp)


def test_llama_matches_hf_with_uneven_pipeline_stages(parity):
    """num_layers_in_first_pipeline_stage=1 at PP=2: the 4 layers split 1 + 3 (the other models' 2 layers
    1 + 1); loading, logits, the round trip and the export all follow Megatron's layer numbering."""
    ranks = parity("pp2-uneven")
    assert [rank["llama"]["layer_numbers"] for rank in ranks] == [[1], [2, 3, 4]]
    assert [rank["qwen2"]["layer_numbers"] for rank in ranks] == [[1], [2]]
    assert_parity(ranks, "llama", 1)


def test_llama3_rope_scaling_uses_all_config_parameters(parity):
    _, last = arch_results(parity("tp1"), "llama")
    # Matches HF's inverse frequencies exactly, where Megatron's fixed 8192-context scaling would not.
    assert last["inv_freq_max_diff"] <= 1e-9
    assert last["builtin_llama3_max_diff"] > 1e-3


def test_llama_provider_config():
    provider = get_provider(tiny_config("llama"))
    assert isinstance(provider, LlamaProvider)
    assert (provider.num_query_groups, provider.head_dim, provider.tied_embeddings) == (2, 32, False)
    assert [m.megatron for m in provider.mappings()][-1] == "output_layer.weight"
    assert provider.mappings()[-1].hf == ("lm_head.weight",)
