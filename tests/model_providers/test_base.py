"""Config translation (HF config -> TransformerConfig), vocab padding, layer spec, and the errors for
unsupported architectures/features and tensor-parallel sizes that do not divide the heads."""
import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config

from model_providers import PROVIDERS, UnsupportedModelError, get_provider
from model_providers.base import build_layer_spec
from model_providers.tiny_models import QWEN2_0_5B_SHAPE, tiny_config
from megarlhf.config.parallel import ParallelConfig


def test_registry_keys_are_hf_model_types():
    assert PROVIDERS.names() == ["llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"]


def test_unsupported_architecture_names_it_and_lists_supported():
    with pytest.raises(UnsupportedModelError, match=r"unsupported model_type 'gpt2' \(GPT2LMHeadModel\); "
                                                     r"supported: llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, "
                                                     r"qwen3_moe"):
        get_provider(GPT2Config(architectures=["GPT2LMHeadModel"]))


@pytest.mark.parametrize("overrides,message", [
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)), "rope scaling type 'yarn'"),
    (dict(num_local_experts=8), r"mixture of experts \(num_local_experts=8\) in a dense architecture"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(attention_bias=True), "attention_bias=True"),
])
def test_unsupported_features(overrides, message):
    with pytest.raises(UnsupportedModelError, match=message):
        get_provider(tiny_config("llama", **overrides))


def test_transformer_config_translation():
    provider = get_provider(tiny_config("qwen2"))
    c = provider.transformer_config(ParallelConfig(), torch.float32)
    assert (c.num_layers, c.hidden_size, c.ffn_hidden_size, c.num_attention_heads) == (2, 128, 256, 4)
    assert (c.num_query_groups, c.kv_channels, c.layernorm_epsilon) == (2, 32, 1e-6)
    assert c.normalization == "RMSNorm" and c.gated_linear_unit and c.activation_func is F.silu
    assert c.add_bias_linear is False and c.add_qkv_bias is True and c.qk_layernorm is False
    assert c.hidden_dropout == 0.0 and c.attention_dropout == 0.0 and c.params_dtype == torch.float32
    assert c.use_cpu_initialization is True  # the CPU layer's overrides are merged in (no CUDA here)
    assert provider.transformer_config(ParallelConfig(), torch.bfloat16, hidden_dropout=0.1).bf16 is True


@pytest.mark.parametrize("tp,message", [
    (3, "tensor_model_parallel_size=3 does not divide num_attention_heads=4"),
    (4, r"tensor_model_parallel_size=4 does not divide num_key_value_heads=2 \(query groups\)"),
])
def test_tp_must_divide_heads_and_groups(tp, message):
    provider = get_provider(tiny_config("qwen2", num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match=message):
        provider.transformer_config(ParallelConfig(tensor_model_parallel_size=tp))


def test_pp_must_split_the_layers_and_uneven_stages_reach_megatron():
    provider = get_provider(tiny_config("llama"))  # 4 layers
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=3 cannot split the model's 4 layers.*"
                                         r"num_hidden_layers of this llama model"):
        provider.transformer_config(ParallelConfig(pipeline_model_parallel_size=3))
    config = provider.transformer_config(ParallelConfig(pipeline_model_parallel_size=3,
                                                        num_layers_in_first_pipeline_stage=2))
    assert (config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage) == (2, None)


def test_vocab_padding():
    provider = get_provider(tiny_config("qwen2", **QWEN2_0_5B_SHAPE))
    assert provider.padded_vocab_size(1) == 151936  # already a multiple of 128
    assert provider.padded_vocab_size(2) == 152064  # next multiple of 256
    assert get_provider(tiny_config("qwen2", vocab_size=300)).padded_vocab_size(1) == 384


def test_local_layer_spec_on_cpu_has_qk_norm_only_for_qwen3():
    from megatron.core.transformer.identity_op import IdentityOp

    for arch, expect_norm in (("qwen3", True), ("llama", False)):
        config = get_provider(tiny_config(arch)).transformer_config(ParallelConfig())
        attention = build_layer_spec(config).submodules.self_attention.submodules
        assert (attention.q_layernorm is not IdentityOp) == expect_norm
        assert (attention.k_layernorm is not IdentityOp) == expect_norm


def test_local_layer_spec_uses_cp_attention_for_cp_or_packing():
    from functools import partial

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from parallel.cp_attention import ContextParallelAttention

    def core_attention(parallel, packed):
        config = get_provider(tiny_config("llama")).transformer_config(parallel)
        return build_layer_spec(config, packed).submodules.self_attention.submodules.core_attention

    assert core_attention(ParallelConfig(), packed=False) is DotProductAttention
    for parallel, packed in ((ParallelConfig(), True), (ParallelConfig(context_parallel_size=2), False)):
        attention = core_attention(parallel, packed)
        assert isinstance(attention, partial) and attention.func is ContextParallelAttention


def test_hf_tensor_shapes_follow_transformers():
    shapes = get_provider(tiny_config("qwen3")).hf_tensor_shapes()
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (128, 64)  # 4 heads x head_dim 32
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (32,)
    assert shapes["lm_head.weight"] == (384, 64)
    value = get_provider(tiny_config("qwen3")).hf_tensor_shapes("value")
    assert value["score.weight"] == (1, 64) and "lm_head.weight" not in value


def test_a_broken_transformer_engine_install_is_an_error_naming_the_import(monkeypatch):
    """With CUDA and TE installed, a TE that fails to import used to fall back to the local spec silently."""
    import importlib.machinery
    import sys

    from model_providers import base

    monkeypatch.setattr(base.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(base.importlib.util, "find_spec",
                        lambda name: importlib.machinery.ModuleSpec(name, None) if name == "transformer_engine" else None)
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # the import fails (ModuleNotFoundError)
    with pytest.raises(RuntimeError, match=r"'import transformer_engine.pytorch' failed \(ModuleNotFoundError"):
        base.uses_transformer_engine()
    monkeypatch.setattr(base.importlib.util, "find_spec", lambda name: None)
    assert base.uses_transformer_engine() is False  # not installed: Megatron's local modules


def test_only_megatrons_gpt_model_deprecation_banner_is_dropped():
    """Megatron logs the banner at every GPTModel construction; megarlhf drops that message, nothing else."""
    import logging

    from megatron.core.models.gpt import gpt_model

    from model_providers.gpt_model import DEPRECATION_BANNER

    def passes(message: str) -> bool:
        return gpt_model.logger.filter(gpt_model.logger.makeRecord(gpt_model.logger.name, logging.WARNING,
                                                                    __file__, 0, message, (), None))

    assert not passes(f"{DEPRECATION_BANNER}. GPTModel is only accepting critical bug fixes, no new features.")
    assert passes("some other warning of Megatron's GPTModel")
