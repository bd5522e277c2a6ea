"""Mixture-of-experts converters and expert parallelism: Megatron logits == HF fp32 logits for Qwen3-MoE
(dense first layer, renormalised top-2 of 8), Qwen2-MoE (gated shared expert, plain top-2 of 6) and Mixtral
(top-2 of 6) at EP1, EP2, TP2, PP2 (and EP2 x TP2 on 4 ranks, slow); HF -> Megatron -> HF bit-exact; exports
that transformers loads and generates from identically; bad inputs refused by name."""
import pytest

from model_providers import get_provider
from model_providers.tiny_models import tiny_config
from megarlhf.config.parallel import ParallelConfig

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
LOGIT_TOL = 1e-5


@pytest.mark.parametrize("layout", ["ep1", "ep2", pytest.param("tp2", marks=pytest.mark.slow),
                                    pytest.param("pp2", marks=pytest.mark.slow),
                                    pytest.param("ep2tp2", marks=pytest.mark.slow)])
def test_moe_matches_hf(moe_parity, layout):
    ranks = moe_parity(layout)
    for arch in ARCHS:
        last = [r for r in ranks if r["last_stage"]]
        for rank in last:
            assert rank[arch]["logit_max_diff"] <= LOGIT_TOL, (arch, rank[arch]["logit_max_diff"])
            assert rank[arch]["logit_max_abs"] > 0.1  # the logits are not trivially small
        for rank in ranks:
            assert rank[arch]["round_trip"] == {"missing": [], "extra": [], "duplicates": 0, "not_equal": []}, arch
            assert rank[arch]["export"]["reload_equal"] is True
        export = ranks[0][arch]["export"]
        assert export["weights_equal"] is True and export["generations_equal"] is True, arch
        assert len(export["generated"][0]) == 12


def test_experts_are_split_over_expert_parallel_ranks(moe_parity):
    ranks = moe_parity("ep2")
    assert [r["qwen3_moe"]["experts"] for r in ranks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [r["mixtral"]["experts"] for r in ranks] == [[0, 1, 2], [3, 4, 5]]
    assert [r["qwen3_moe"]["experts"] for r in moe_parity("ep1")] == [list(range(8))]


def test_moe_bad_inputs_are_named(moe_parity):
    errors = moe_parity("ep1")[0]["errors"]
    assert "missing 1 tensor(s): model.layers.2.mlp.experts.5.up_proj.weight" in errors["missing_expert"]
    assert errors["missing_expert_wrote"] is False
    assert "expert_model_parallel_size=3 does not divide num_experts=8" in errors["ep_not_dividing"]
    assert "router setting n_group=4" in errors["router_n_group"]
    assert "router setting scoring_func='sigmoid'" in errors["router_scoring_func"]
    assert "router setting router_jitter_noise=0.1" in errors["router_router_jitter_noise"]
    assert "needs a mixture-of-experts model" in errors["ep_on_dense"]


def test_moe_config_translation():
    q3 = get_provider(tiny_config("qwen3_moe")).transformer_config(ParallelConfig())
    assert (q3.num_moe_experts, q3.moe_router_topk, q3.moe_ffn_hidden_size, q3.ffn_hidden_size) == (8, 2, 32, 128)
    assert q3.moe_layer_freq == [0, 1, 1] and q3.moe_router_pre_softmax is False  # renormalised top-k
    assert q3.moe_router_dtype == "fp32" and q3.moe_expert_capacity_factor is None  # dropless
    q2 = get_provider(tiny_config("qwen2_moe")).transformer_config(ParallelConfig())
    assert q2.moe_router_pre_softmax is True and q2.moe_shared_expert_gate is True  # softmax over all experts
    assert q2.moe_shared_expert_intermediate_size == 64 and q2.add_qkv_bias is True
    mixtral = get_provider(tiny_config("mixtral", norm_topk_prob=False)).transformer_config(ParallelConfig())
    assert mixtral.moe_router_pre_softmax is False  # Mixtral always renormalises
    sparse = get_provider(tiny_config("qwen3_moe", mlp_only_layers=[], decoder_sparse_step=2))
    assert sparse.moe_layer_pattern() == [0, 1, 0]


def test_moe_layout_validation():
    from megarlhf.config.parallel import LayoutError

    with pytest.raises(LayoutError, match="expert_model_parallel_size \\(4\\)"):
        ParallelConfig(expert_model_parallel_size=4).validate(2)
    assert ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2).data_parallel_size(4) == 2
    with pytest.raises(LayoutError, match="expert_model_parallel_size must be a positive integer"):
        ParallelConfig(expert_model_parallel_size=0)


def test_moe_refusals_name_the_setting():
    from model_providers import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="mixtral config: sliding_window=64 < max_position_embeddings=256"):
        get_provider(tiny_config("mixtral", sliding_window=64))
    with pytest.raises(UnsupportedModelError, match="shared_expert_intermediate_size=0"):
        get_provider(tiny_config("qwen2_moe", shared_expert_intermediate_size=0))
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=9 with 8 experts"):
        get_provider(tiny_config("qwen3_moe", num_experts_per_tok=9))
    with pytest.raises(UnsupportedModelError, match=r"settings \['moe_aux_loss_coeff'\] \(model.moe\) given for this "
                                                    "dense qwen2 model"):
        get_provider(tiny_config("qwen2")).transformer_config(ParallelConfig(), moe_aux_loss_coeff=0.01)
