"""HF checkpoint I/O without a model: clear errors for missing directories/files, partial (sliced) reads,
and the streaming shard writer's HF layout (single file, or shards plus an index). The load/export paths
through a live sharded model are checked in the parity runs (test_llama.py etc.; their error messages
and the bf16 path below)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_providers.hf_checkpoint import CheckpointError, HFCheckpoint, _ShardWriter, load_hf_model


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match=f"HF checkpoint directory {tmp_path / 'nope'} does not exist"):
        HFCheckpoint(tmp_path / "nope")


def test_no_safetensors(tmp_path):
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        HFCheckpoint(tmp_path)


def test_index_lists_missing_shard(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"lists missing files \['model-00002-of-00002.safetensors'\]"):
        HFCheckpoint(tmp_path)


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_hf_model(tmp_path)


def test_sliced_reads(tmp_path):
    w = torch.arange(24.0).reshape(4, 6)
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    with HFCheckpoint(tmp_path) as ckpt:
        src = ckpt.source("w")
        assert src.shape == (4, 6) and "w" in ckpt and "x" not in ckpt
        assert torch.equal(src[1:3], w[1:3]) and torch.equal(src[:, 2:4], w[:, 2:4])


def test_shard_writer_single_and_sharded(tmp_path):
    tensors = {f"t{i}": torch.full((10,), float(i)) for i in range(5)}  # 40 bytes each
    for directory, limit, files in ((tmp_path / "one", 10_000, 1), (tmp_path / "many", 100, 3)):
        directory.mkdir()
        writer = _ShardWriter(directory, limit)
        for name, t in tensors.items():
            writer.add(name, t)
        writer.finish()
        shards = sorted(p.name for p in directory.glob("*.safetensors"))
        assert len(shards) == files
        loaded = {}
        for shard in shards:
            loaded.update(load_file(str(directory / shard)))
        assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 200
    assert index["weight_map"]["t4"] == "model-00003-of-00003.safetensors"
    assert HFCheckpoint(tmp_path / "many").weight_map == index["weight_map"]


def test_checkpoint_errors_name_the_tensor(parity):
    errors = parity("tp1")[0]["errors"]
    assert errors["missing_tensor"].endswith("is missing 1 tensor(s): model.layers.1.mlp.up_proj.weight")
    assert errors["wrong_shape"].endswith("tensor model.layers.0.self_attn.k_proj.weight in model.safetensors "
                                          "has shape [32, 128], but the config expects [64, 128]")


def test_bf16_model_from_fp32_checkpoint(parity):
    bf16 = parity("tp1")[0]["bf16"]
    assert bf16 == {"param_dtypes": ["torch.bfloat16"], "not_equal": []}
