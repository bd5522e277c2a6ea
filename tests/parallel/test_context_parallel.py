"""Tests for parallel/context_parallel.py, parallel/cp_attention.py and parallel/cp_sharding.py.

References: Megatron's own local attention at CP=1 (one 2-rank launch, see the worker), a naive
full-matrix masked softmax attention in float64 (the tiled kernel), Megatron's rotary CP split
functions (token assignment), and hand-worked index lists.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megarlhf.testing.launch import read_rank_results, run_torchrun
from parallel.context_parallel import make_shard_plan, rank_token_index, shard, with_cp_attention
from parallel.cp_attention import (ContextParallelAttention, Tiling, TokenLayout, _LocalTiledAttention,
                                  per_sequence_attention)

WORKER = Path(__file__).with_name("_worker_context_parallel.py")
TOL = 1e-5


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    run_torchrun(WORKER, 2, [str(out)], timeout_s=300)
    return read_rank_results(out, 2)


@pytest.mark.parametrize("comm", ["all_gather", "p2p"])
def test_cp2_matches_cp1_unpacked(cp_results, comm):
    for rank in cp_results:
        assert rank["rotary_split_matches"]
        assert rank[f"{comm}_unpacked_logits"] <= TOL
        assert rank[f"{comm}_unpacked_grads"] <= TOL, rank["unpacked_grad_scale"]


@pytest.mark.parametrize("comm", ["all_gather", "p2p"])
def test_cp2_matches_cp1_packed_gqa(cp_results, comm):
    for rank in cp_results:
        assert rank["local_tokens"] == (16 + 32 + 8 + 20) // 2  # every sequence padded to 2*cp
        assert rank[f"{comm}_packed_logits"] <= TOL
        assert rank[f"{comm}_packed_loss"] <= TOL
        assert rank[f"{comm}_packed_grads"] <= TOL, rank["packed_grad_scale"]


def test_roundtrips_cp1_packing_and_dp_token_mean(cp_results):
    for rank in cp_results:
        assert rank["roundtrip_unpacked"] and rank["roundtrip_packed"]
        assert rank["unshard_grads"] <= TOL  # a replicated loss through unshard: summed grads = CP=1
        assert rank["cp1_packed_logits"] <= TOL  # CP attention at cp=1 vs sequences run one by one
        assert rank["dp_loss"] <= TOL and rank["dp_grads"] <= TOL


def test_rank_token_index_head_and_tail_by_hand():
    # Two sequences of padded length 8 and 4, cp=2: chunks of 2 and 1 tokens.
    cu = torch.tensor([0, 8, 12])
    assert rank_token_index(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert rank_token_index(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


def test_plan_pads_each_sequence_and_covers_every_token_once():
    # Lengths 5, 1, 10 -> padded 8, 4, 12 -> chunks of 2, 1, 3 tokens.
    plan = make_shard_plan([0, 5, 6, 16], cp_size=2, cp_rank=0)
    assert plan.cu_seqlens_padded.tolist() == [0, 8, 12, 24]
    both = torch.cat([plan.for_rank(r).local_index for r in range(2)])
    assert sorted(both.tolist()) == list(range(24))
    assert plan.local_position_ids().tolist() == [0, 1, 6, 7, 0, 3, 0, 1, 2, 9, 10, 11]
    assert plan.local_is_padding().tolist() == [False, False, True, True, False, True,
                                                False, False, False, False, True, True]
    tokens = torch.arange(100, 116)
    local = shard(plan, tokens, pad_value=-1)
    assert local.tolist() == [100, 101, -1, -1, 105, -1, 106, 107, 108, 115, -1, -1]


def test_split_matches_megatron_thd_rotary_positions():
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    freqs = torch.arange(64)
    for cp in (2, 4):
        plan0 = make_shard_plan([0, 9, 40, 47], cp, 0)
        for rank in range(cp):
            plan = plan0.for_rank(rank)
            padded = plan.cu_seqlens_padded.tolist()
            expected = torch.cat([
                _get_thd_freqs_on_this_cp_rank(rank, cp, torch.empty((end - start) // cp), freqs)
                for start, end in zip(padded[:-1], padded[1:])])
            assert torch.equal(plan.local_position_ids(), expected)


@pytest.mark.parametrize("block", [3, 64])
def test_tiled_attention_matches_naive_float64_packed_gqa(block):
    torch.manual_seed(0)
    cu, cp, groups, per_group, dim = (0, 8, 24, 32), 2, 2, 2, 8
    q = torch.randn(1, groups, per_group, 32, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, groups, 1, 32, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, groups, 1, 32, dim, dtype=torch.float64, requires_grad=True)
    idx, bounds = torch.arange(32), torch.tensor(cu)
    start = bounds[torch.searchsorted(bounds, idx, right=True) - 1]
    visible = (idx[None] <= idx[:, None]) & (idx[None] >= start[:, None])
    scores = (q @ k.transpose(-1, -2) / math.sqrt(dim)).masked_fill(~visible, -math.inf)
    ref = torch.softmax(scores, -1) @ v
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * grad).sum(), (q, k, v))
    layouts = [TokenLayout.of_rank(cu, cp, r) for r in range(cp)]
    keys = TokenLayout(torch.cat([lay.index for lay in layouts]), torch.cat([lay.start for lay in layouts]))
    total = 0
    for lay in layouts:
        out = _LocalTiledAttention.apply(q[..., lay.index, :], k[..., keys.index, :], v[..., keys.index, :],
                                         (lay, keys), Tiling(1 / math.sqrt(dim), block))
        assert (out - ref[..., lay.index, :]).abs().max() < 1e-12
        total = total + (out * grad[..., lay.index, :]).sum()
    for mine, expected in zip(torch.autograd.grad(total, (q, k, v)), ref_grads):
        assert (mine - expected).abs().max() < 1e-12


def test_shared_prefix_attention_matches_separate_sequences_float64_gqa():
    """Two branches over one prefix (segments [0, 5) | [5, 9) | [9, 16)) give, with their values and
    gradients, the attention of the two whole sequences prefix + branch computed apart; a third plain
    segment [16, 20) stays causal on its own."""
    torch.manual_seed(0)
    groups, per_group, dim, scale = 2, 2, 8, 0.3
    q = torch.randn(1, groups, per_group, 20, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, groups, 1, 20, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, groups, 1, 20, dim, dtype=torch.float64, requires_grad=True)
    out = per_sequence_attention(q, k, v, (0, 5, 9, 16, 20), scale, prefix_of=(-1, 0, 0, -1))
    grad = torch.randn_like(out)
    grads = torch.autograd.grad((out * grad).sum(), (q, k, v))

    def naive(index):  # plain causal attention over the tokens ``index`` as one sequence
        qi, ki, vi = q[..., index, :], k[..., index, :], v[..., index, :]
        causal = torch.ones(len(index), len(index), dtype=torch.bool).tril()
        return torch.softmax((qi @ ki.transpose(-1, -2) * scale).masked_fill(~causal, -math.inf), -1) @ vi

    first, second, plain = list(range(0, 9)), list(range(5)) + list(range(9, 16)), list(range(16, 20))
    ref_first, ref_second, ref_plain = naive(first), naive(second), naive(plain)
    assert (out[..., :9, :] - ref_first).abs().max() < 1e-12
    assert (out[..., 9:16, :] - ref_second[..., 5:, :]).abs().max() < 1e-12
    assert (out[..., 16:, :] - ref_plain).abs().max() < 1e-12
    # the prefix's gradient is the sum over both sequences (its outputs counted once, in the first)
    loss = ((ref_first * grad[..., :9, :]).sum() + (ref_second[..., 5:, :] * grad[..., 9:16, :]).sum()
            + (ref_plain * grad[..., 16:, :]).sum())
    for mine, expected in zip(grads, torch.autograd.grad(loss, (q, k, v))):
        assert (mine - expected).abs().max() < 1e-12


def test_with_cp_attention_swaps_only_when_needed():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    assert with_cp_attention(spec, 1).submodules.self_attention.submodules.core_attention is DotProductAttention
    swapped = with_cp_attention(spec, 2).submodules.self_attention.submodules.core_attention
    assert swapped.func is ContextParallelAttention
    assert spec.submodules.self_attention.submodules.core_attention is DotProductAttention  # input untouched
    with pytest.raises(ValueError, match="no local DotProductAttention"):
        with_cp_attention(with_cp_attention(spec, 2), 2)


@pytest.mark.parametrize("cu, cp, padding, message", [
    ([0, 30], 2, False, "not divisible by 2 \\* context_parallel_size = 4"),
    ([0, 8, 8], 2, True, "sequence 1 of the packed batch has length 0"),
    ([0, 8], 0, True, "positive integer"),
])
def test_shard_plan_errors_explain_the_constraint(cu, cp, padding, message):
    with pytest.raises(ValueError, match=message):
        make_shard_plan(cu, cp, 0, allow_padding=padding)


def test_flex_block_mask_gives_the_per_segment_attention(monkeypatch):
    """The FlexAttention path's block mask (plain segments, and branches seeing their prefix whole) gives
    the outputs of the per-segment SDPA loop. Forward only, eager: FlexAttention has no backward on CPU;
    the GPU check compares gradients through the model."""
    from torch.nn.attention.flex_attention import flex_attention

    from parallel import flex_packed_attention as flex

    monkeypatch.setattr(flex, "_compiled_flex", lambda: flex_attention)
    torch.manual_seed(0)
    bounds, prefix_of = (0, 5, 9, 16, 20, 150, 161, 300), (-1, 0, 0, -1, -1, 4, 4)
    groups, per_group, dim, scale = 2, 2, 16, 0.3
    q = torch.randn(1, groups, per_group, 300, dim)
    k, v = torch.randn(1, groups, 1, 300, dim), torch.randn(1, groups, 1, 300, dim)
    for prefixes in (prefix_of, None):
        mask = flex.segment_block_mask(bounds, prefixes, q.device)
        with torch.no_grad():
            out = flex.flex_packed_attention(q, k, v, mask, scale)
        expected = per_sequence_attention(q, k, v, bounds, scale, prefix_of=prefixes)
        assert (out - expected).abs().max() < 1e-5


def test_flex_block_mask_is_built_once_per_micro_batch():
    from parallel.cp_sharding import HostBoundsSeqParams
    from parallel.flex_packed_attention import block_mask_for

    params = HostBoundsSeqParams(qkv_format="thd", padded_bounds=(0, 3, 7))
    first = block_mask_for(params, (0, 3, 7), None, torch.device("cpu"))
    assert block_mask_for(params, (0, 3, 7), None, torch.device("cpu")) is first
    assert block_mask_for(params, (0, 3, 7), (-1, 0), torch.device("cpu")) is not first


@pytest.mark.parametrize("bounds, prefix_of", [
    ((0, 5, 9, 16, 20, 150, 161, 300), (-1, 0, 0, -1, -1, 4, 4)),
    ((0, 128, 256, 300, 700, 1000, 1025), (-1, 0, 0, -1, 3, 3)),  # tile-aligned and ragged ends
    ((0, 513), None),
])
def test_flex_block_mask_equals_torchs_own(bounds, prefix_of):
    """The block mask built a few rows at a time is the one torch's create_block_mask builds from every
    token pair: the same token-level mask, the same partial and full tiles."""
    from torch.nn.attention.flex_attention import create_block_mask

    from parallel import flex_packed_attention as flex

    mine = flex.segment_block_mask(bounds, prefix_of, torch.device("cpu"))
    total = bounds[-1]
    reference = create_block_mask(mine.mask_mod, None, None, total, total, device="cpu")
    assert torch.equal(mine.to_dense(), reference.to_dense())
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(mine, name), getattr(reference, name)), name
    for num, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        for row, count in enumerate(getattr(mine, num)[0, 0].tolist()):
            assert sorted(getattr(mine, indices)[0, 0, row, :count].tolist()) == sorted(
                getattr(reference, indices)[0, 0, row, :count].tolist()), (indices, row)
