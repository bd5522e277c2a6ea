"""Mapping kinds vs naive references: each kind's TP shards are built here by hand (explicit loops over
query groups and heads), then ``load`` must produce them and ``export`` must invert them exactly."""
import pytest
import torch

from model_providers.mapping import (COLUMN, GATED_MLP, QKV, REPLICATED, ROW, VOCAB, ShardContext,
                                     WeightMapping)


def ctx(rank, tp, heads=8, groups=2, head_dim=3, vocab=10, padded=16):
    return ShardContext(rank, tp, heads, groups, head_dim, vocab, padded)


def naive_qkv_shard(q, k, v, rank, tp, heads, groups, d):
    """Megatron's fused layout written out: for each of this rank's groups, its q heads, then k, then v."""
    rows = []
    per_group = heads // groups
    for g in range(rank * groups // tp, (rank + 1) * groups // tp):
        for h in range(g * per_group, (g + 1) * per_group):
            rows.append(q[h * d:(h + 1) * d])
        rows.append(k[g * d:(g + 1) * d])
        rows.append(v[g * d:(g + 1) * d])
    return torch.cat(rows)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("trailing", [(5,), ()])  # weight and bias
def test_fused_qkv(tp, trailing):
    heads, groups, d = 8, 2, 3
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(heads * d, *trailing, generator=gen)
    k = torch.randn(groups * d, *trailing, generator=gen)
    v = torch.randn(groups * d, *trailing, generator=gen)
    shards = [QKV.load([q, k, v], ctx(r, tp, heads, groups, d)) for r in range(tp)]
    for r, shard in enumerate(shards):
        assert torch.equal(shard, naive_qkv_shard(q, k, v, r, tp, heads, groups, d))
    back = QKV.export(shards, ctx(0, tp, heads, groups, d))
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_gated_mlp_per_rank_layout():
    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    shards = [GATED_MLP.load([gate, up], ctx(r, 2)) for r in range(2)]
    assert torch.equal(shards[1], torch.cat([gate[2:], up[2:]]))
    back = GATED_MLP.export(shards, ctx(0, 2))
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)


def test_column_row_replicated():
    w = torch.randn(4, 6)
    assert torch.equal(COLUMN.load([w], ctx(1, 2)), w[2:])
    assert torch.equal(ROW.load([w], ctx(1, 2)), w[:, 3:])
    assert torch.equal(COLUMN.export([w[:2], w[2:]], ctx(0, 2))[0], w)
    assert torch.equal(ROW.export([w[:, :3], w[:, 3:]], ctx(0, 2))[0], w)
    assert torch.equal(REPLICATED.load([w], ctx(1, 2)), w)
    with pytest.raises(ValueError, match="not divisible by tensor parallel size 4"):
        ROW.load([w], ctx(0, 4))


def test_vocab_padding_zero_in_dropped_out():
    emb = torch.randn(10, 3)  # vocab 10 padded to 16 over 2 ranks: rank 1 holds rows 8..15
    shards = [VOCAB.load([emb], ctx(r, 2)) for r in range(2)]
    assert torch.equal(shards[0], emb[:8])
    assert torch.equal(shards[1][:2], emb[8:]) and torch.count_nonzero(shards[1][2:]) == 0
    assert shards[1].shape == (8, 3)
    assert torch.equal(VOCAB.export(shards, ctx(0, 2))[0], emb)


def test_mapping_entry_checks_tensor_count():
    with pytest.raises(ValueError, match="FusedQKV takes 3 HF tensors, got 1"):
        WeightMapping("decoder.layers.{layer}.self_attention.linear_qkv.weight", ("q",), QKV)
