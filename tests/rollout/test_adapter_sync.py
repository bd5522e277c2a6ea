"""Adapter-only sync of a LoRA policy into vLLM's LoRA engine (megarlhf.rollout.sync.adapters).

The engine-level tests build a LoRA-enabled vLLM engine on a tiny Llama and the tiny Qwen2 (tied head,
qkv bias, GQA) in one process (~10 s each: slow-marked). They check that a sync of trained adapters verifies bit for bit
in fp32 and bf16 (rank 3 padded to vLLM's 8, a scale that rounds), that the engine then generates with
the adapters (its prompt log-probs equal the trainer's LoRA forward to fp32 noise, and differ from the
base's), and that the faults the fingerprints exist for are caught and named: an engine left on the
previous step's adapter, and a scale vLLM failed to fold in.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from megarlhf.config.model import ModelConfig
from megarlhf.config.schema import RunConfig
from megarlhf.core.errors import ConfigError
from megarlhf.rollout.sync.adapters import engine_slot_name, slot_problems

FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def test_engine_slot_names_follow_vllms_fused_layers():
    prefix = "base_model.model.model.layers.3"
    assert engine_slot_name(f"{prefix}.self_attn.k_proj.lora_B.weight", FUSED) == \
        "model.layers.3.self_attn.qkv_proj.lora_b.1"
    assert engine_slot_name(f"{prefix}.mlp.up_proj.lora_A.weight", FUSED) == "model.layers.3.mlp.gate_up_proj.lora_a.1"
    assert engine_slot_name(f"{prefix}.self_attn.o_proj.lora_A.weight", FUSED) == \
        "model.layers.3.self_attn.o_proj.lora_a.0"
    with pytest.raises(ValueError, match="not a PEFT LoRA factor"):
        engine_slot_name(f"{prefix}.self_attn.o_proj.weight", FUSED)


def test_slot_problems_name_every_kind_of_difference():
    expected = {"a.lora_a.0": (1, 2), "a.lora_b.0": (3, 4), "b.lora_a.0": (5, 6)}
    report = {"adapters": {"a.lora_a.0": [1, 2], "a.lora_b.0": [3, 5], "c.lora_a.0": [0, 0], "d.lora_b.0": [7, 8]},
              "problems": []}
    problems = slot_problems(expected, report)
    assert any("a.lora_b.0 differs from the trainer's" in p for p in problems)
    assert any("d.lora_b.0 holds an adapter the trainer did not send" in p for p in problems)
    assert any("no engine LoRA slot holds the trainer's b.lora_a.0" in p for p in problems)
    assert len(problems) == 3  # c: an empty slot the trainer sent nothing for is fine


@pytest.mark.parametrize("override, message", [
    ({}, "needs model.lora"),
    ({"lora": True, "backend": "hf"}, "needs an engine that loads adapters alone; rollout.backend='hf'"),
    ({"lora": True, "tensor_parallel_size": 2}, "rollout.tensor_parallel_size must be 1"),
    ({"lora": True, "rank": 600}, "rank at most 512"),
    ({"lora": True, "check_checkpoint": False}, "must be proven equal to the trainer's at start-up"),
    ({"lora": True, "engine_dtype": "float32", "model_dtype": "bfloat16"}, "no finer than model.dtype"),
])
def test_adapter_sync_refuses_what_it_cannot_verify(override, message):
    from megarlhf.config.data import DataConfig
    from megarlhf.config.rollout import RolloutConfig, WeightSyncConfig
    from megarlhf.config.model import LoRAConfig
    from megarlhf.run.checks import check_config

    rollout = dict(weight_sync=WeightSyncConfig(lora="adapter", check_checkpoint=override.get("check_checkpoint", True)),
                   backend=override.get("backend", "vllm"), tensor_parallel_size=override.get("tensor_parallel_size", 1),
                   dtype=override.get("engine_dtype"))
    with pytest.raises((ValueError, ConfigError), match=message):  # as a run's start checks it
        check_config(RunConfig(model=ModelConfig(path="m", dtype=override.get("model_dtype", "float32"),
                                                 lora=LoRAConfig(rank=override.get("rank", 8))
                                                 if override.get("lora") else None),
                               data=DataConfig(train_path="t.jsonl"), rollout=RolloutConfig(**rollout)))
    with pytest.raises(ValueError, match="'merged' or 'adapter'"):
        WeightSyncConfig(lora="adapters")


def _build(model_dir, dtype: str, rank: int, alpha: float):
    """A LoRA actor (random, trained-looking B) and a calibrated adapter sync into a LoRA vLLM engine."""
    from megarlhf.config.data import DataConfig
    from megarlhf.rollout.sync.adapters import AdapterSync, engine_lora
    from megarlhf.rollout.sync.calibration import calibrate_colocated
    from megarlhf.config.rollout import RolloutConfig, WeightSyncConfig
    from megarlhf.rollout.engines import EngineConfig
    from megarlhf.rollout.engines.vllm import VLLMEngine
    from megarlhf.learner import TrainModel
    from model_providers.hf_checkpoint import load_hf_model
    from megarlhf.config.parallel import ParallelConfig
    from megarlhf.config.model import LoRAConfig
    from parallel.lora import attach_lora
    from parallel.runtime import init_parallel

    runtime = init_parallel(ParallelConfig())
    lora = LoRAConfig(rank=rank, alpha=alpha)
    config = RunConfig(model=ModelConfig(path=str(model_dir), dtype=dtype, lora=lora),
                       data=DataConfig(train_path="unused.jsonl", max_prompt_length=32),
                       rollout=RolloutConfig(max_new_tokens=16, kv_cache_mb=64,
                                             weight_sync=WeightSyncConfig(lora="adapter", probe_length=24,
                                                                               probe_max_length=0)))
    provider, model = load_hf_model(model_dir, params_dtype=getattr(torch, dtype), packed_sequences=True)
    attach_lora(model, lora, seed=0)
    actor = TrainModel("actor", model, provider, runtime)
    engine = VLLMEngine(str(model_dir), EngineConfig.from_rollout(config.rollout, model_dtype=dtype, seed=0,
                                                                     max_prompt_length=32, **engine_lora(config)))
    sync = AdapterSync(engine, actor, config)
    calibration = calibrate_colocated(sync, [], ())  # the base, bit for bit, while B = 0
    assert calibration["gates/calibration_checkpoint_bitwise"] == 1.0
    return sync, model


def _train(model, seed: int) -> None:
    from parallel.lora import adapters_of

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for adapter in adapters_of(model):
            adapter.B.copy_(torch.randn(adapter.B.shape, generator=gen) * 0.05)


@pytest.mark.slow  # builds a LoRA vLLM engine (~10 s)
def test_adapter_sync_verifies_and_the_engine_generates_with_the_adapters(tmp_path, monkeypatch):
    """On a Llama (vLLM gives its LM head a LoRA layer unless the engine names the adapted projections;
    that layer breaks the probe's prompt log-probs, as it did on SmolLM2)."""
    from megarlhf.rollout.sync import adapters as adapter_sync
    from megarlhf.rollout.sync.weights import WeightSyncError
    from model_providers.tiny_models import make_tiny_model

    sync, model = _build(make_tiny_model("llama", tmp_path / "llama", seed=3), "float32", rank=4, alpha=8.0)
    base_probe = sync.engine.prompt_logprobs(sync.probe)
    _train(model, seed=1)
    metrics = sync.sync()
    assert metrics["weight_sync/probe_max_abs_diff"] < 1e-4  # the engine's LoRA kernels give the trainer's
    adapted_probe = sync.engine.prompt_logprobs(sync.probe)
    moved = max(abs(a - b) for row_a, row_b in zip(adapted_probe, base_probe) for a, b in zip(row_a, row_b))
    assert moved > 1e-2  # ... which are not the base model's
    assert metrics["weight_sync/bytes"] < 0.2 * sum(p.numel() * 4 for p in model.parameters())

    _train(model, seed=2)  # a stale engine: the adapter it is pointed at is the previous step's
    previous, write = sync.directory.current, adapter_sync.write_peft_adapter
    monkeypatch.setattr(adapter_sync, "write_peft_adapter",
                        lambda tensors, config, path: shutil.copytree(previous, path))
    with pytest.raises(WeightSyncError, match=r"LoRA slot model\.layers\.\d\.\S+\.lora_b\.\d differs"):
        sync.sync()
    monkeypatch.setattr(adapter_sync, "write_peft_adapter", write)
    monkeypatch.setattr(sync.engine, "load_adapter", lambda path: 1 / 0)  # a failed load is a verdict, not a hang
    with pytest.raises(WeightSyncError, match="the engine failed to load the adapter: division by zero"):
        sync.sync()


@pytest.mark.slow  # builds a LoRA vLLM engine (~10 s)
def test_adapter_sync_in_bf16_predicts_vllms_scaling_and_catches_it_missing(tiny_qwen2, monkeypatch):
    from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

    from megarlhf.rollout.sync.weights import WeightSyncError

    sync, model = _build(tiny_qwen2, "bfloat16", rank=3, alpha=5.0)  # scale 5/3 rounds in bf16; rank 3 -> 8
    _train(model, seed=1)
    assert sync.sync()["weight_sync/tensors"] > 0
    _train(model, seed=2)
    for cls in (LoRALayerWeights, PackedLoRALayerWeights):  # vLLM forgetting to fold alpha / rank into B
        monkeypatch.setattr(cls, "optimize", lambda self: self)
    with pytest.raises(WeightSyncError, match=r"lora_b\.\d differs from the trainer's"):
        sync.sync()
