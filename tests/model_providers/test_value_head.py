"""Value head: per-token values == HF ...ForSequenceClassification scores (before pooling), from a
ForSequenceClassification checkpoint and from a causal LM (fresh head), at TP=1, TP=2, PP=2; the reward
model exports back to ForSequenceClassification names bit-exactly."""
import pytest
from _parity_checks import arch_results

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


@pytest.mark.parametrize("layout", ["tp1", "tp2", pytest.param("pp2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("arch", ARCHS)
def test_value_head_matches_hf_scores(parity, layout, arch):
    first, last = arch_results(parity(layout), arch)
    value = last["value"]
    assert value["value_shape"] == [2, 19, 1]
    assert value["value_max_diff"] <= 1e-4, value["value_max_diff"]
    # From a causal LM: HF body hidden states times the freshly drawn head, the same head on all TP ranks.
    assert value["fresh_value_max_diff"] <= 1e-4
    assert value["fresh_head_same_on_tp_ranks"] is True
    assert 0.03 < value["fresh_head_std"] < 0.07  # normal(0, initializer_range=0.05), 64-128 draws
    assert first["value"]["rm_export_equal"] is True
    assert first["value"]["rm_export_loads"].endswith("ForSequenceClassification")
