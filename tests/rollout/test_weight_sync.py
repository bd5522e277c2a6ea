"""Weight sync Megatron -> vLLM: exact arrival (checksums), engine == trainer after every sync (greedy
generations and sampled-token log-probs vs the trainer's own decoding and teacher forcing), before and
after 3 AdamW steps, at trainer TP=1 and TP=2; corrupted syncs stop with the tensor's name."""
from __future__ import annotations

import pytest
import torch

from megarlhf.rollout.config import WeightSyncConfig
from megarlhf.rollout.weight_sync import compare_checksums, tensor_checksum, weight_buckets

LAYOUTS = ("tp1", "tp2")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("phase", ["before", "after"])
def test_engine_matches_trainer(rollout_run, layout, phase):
    for rank in rollout_run(layout):
        r = rank[phase]
        assert r["greedy_prompts"] == 64 and r["greedy_equal"] == 64, r
        assert r["sampled_tokens"] > 64 * 2 * 4
        assert r["logprob_max_diff"] <= 1e-4, r
        assert r["greedy_finish"] == ["length"]  # ignore_eos + max_new_tokens


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_changed_weights_and_resync_verified(rollout_run, layout):
    for rank in rollout_run(layout):
        assert rank["losses"][2] < rank["losses"][0] - 0.5  # the re-sync really had new weights to move
        calibration = rank["calibration"]  # fp32: the floors apply, the calibration gap is far below them
        assert calibration["gates/calibration_probe_max"] < 1e-4 and calibration["gates/probe_max"] == 1e-4
        for key in ("sync0", "sync1"):
            m = rank[key]
            assert m["weight_sync/tensors"] == 26  # 2 layers x 12 + embedding + final norm (tied head)
            assert m["weight_sync/bytes"] == 1380864  # 345216 fp32 values of the tiny qwen2
            assert m["weight_sync/probe_max_abs_diff"] <= 1e-4
            assert m["time/weight_sync_s"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_corrupted_sync_names_the_tensor(rollout_run, layout):
    for rank in rollout_run(layout):
        perturbed, skipped = rank["corrupted"]["perturbed"], rank["corrupted"]["skipped"]
        assert perturbed is not None and "tensor model.layers.1.mlp.down_proj.weight differs" in perturbed
        assert skipped is not None
        assert "tensor model.layers.0.self_attn.k_proj.weight was sent but never reached the engine" in skipped


def test_checksum_sees_one_ulp_dtype_and_shape():
    t = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    u = t.clone()
    u[2, 3] = torch.nextafter(u[2, 3], torch.tensor(float("inf")))
    assert tensor_checksum(t) == tensor_checksum(t.clone())
    assert tensor_checksum(t) != tensor_checksum(u)
    assert tensor_checksum(t) != tensor_checksum(t.reshape(5, 4))
    assert tensor_checksum(t.bfloat16()) != tensor_checksum(t.bfloat16().view(torch.float16))
    assert tensor_checksum(t.t()) == tensor_checksum(t.t().contiguous())


def test_compare_checksums_reports_every_kind_of_difference():
    a, b = torch.zeros(3), torch.ones(3)
    sent = {"x": tensor_checksum(a), "y": tensor_checksum(a), "z": tensor_checksum(a)}
    received = {"x": tensor_checksum(a), "y": tensor_checksum(b), "extra": tensor_checksum(a)}
    problems = compare_checksums(sent, received)
    assert problems[0] == "tensor z was sent but never reached the engine"
    assert problems[1] == "tensor extra reached the engine but was not sent by the trainer"
    assert problems[2].startswith("tensor y differs: trainer torch.float32 [3] crc32=")
    assert len(problems) == 3 and compare_checksums(sent, dict(sent)) == []


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="bucket_mb"):
        WeightSyncConfig(bucket_mb=0)
    with pytest.raises(ValueError, match="probe_length"):
        WeightSyncConfig(probe_length=1)


def test_buckets_are_bounded_and_keep_order():
    mib = 2**20
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate([mib // 2, mib // 2, mib // 4, 3 * mib])]
    stats = {}
    buckets = [[name for name, _ in b] for b in weight_buckets(iter(tensors), 1.0, stats)]
    assert buckets == [["t0", "t1"], ["t2"], ["t3"]]  # a tensor larger than the limit travels alone
    assert stats == {"buckets": 3, "bytes": 4 * mib + mib // 4, "max_bucket_bytes": 3 * mib}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sync_streams_in_bounded_buckets(rollout_run, layout):
    limit = int(0.25 * 2**20)  # the worker's bucket_mb
    for rank in rollout_run(layout):
        m = rank["sync1"]
        assert m["weight_sync/buckets"] >= 5
        assert m["weight_sync/max_bucket_bytes"] <= limit
