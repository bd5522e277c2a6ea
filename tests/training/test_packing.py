"""Micro-batch planning and the token-aligned round trip (single process, CP=1), and the packed forward
equal to the unpacked one and to HF (from the single-rank worker)."""
from __future__ import annotations

import random

import pytest
import torch

from megarlhf.training import build_micro_batches, plan_micro_batches


@pytest.mark.parametrize("packed", [True, False])
def test_plan_respects_budget_and_covers_every_sequence_once(packed):
    rng = random.Random(0)
    for trial in range(50):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(20, 120)
        plan = plan_micro_batches(lengths, budget, packed)
        assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
        for mb in plan:
            cost = sum(lengths[i] for i in mb) if packed else len(mb) * max(lengths[i] for i in mb)
            assert cost <= budget or len(mb) == 1, (trial, mb, budget)  # over-budget sequences alone
        assert plan == plan_micro_batches(list(lengths), budget, packed)  # deterministic


def test_plan_examples():
    # first-fit decreasing under 10: 9 | 7 | 5, then 4 -> third, 3 -> second, 1 -> first
    assert plan_micro_batches([5, 9, 7, 3, 4, 1], 10) == [[1, 5], [2, 3], [0, 4]]
    assert plan_micro_batches([12, 2], 10) == [[0], [1]]  # longer than the budget: its own micro-batch
    # unpacked: longest first, count x longest <= budget
    assert plan_micro_batches([5, 9, 7, 3, 4, 1], 16, packed=False) == [[1], [0, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="token budget must be >= 1"):
        plan_micro_batches([3], 0)


@pytest.mark.parametrize("packed", [True, False])
def test_micro_batches_round_trip_to_token_aligned_rows(packed):
    lengths = torch.tensor([5, 3, 7, 2])
    ids = torch.zeros(4, 7, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        ids[i, :n] = torch.arange(1, n + 1) + 10 * i
    wanted = torch.ones(4, 7, dtype=torch.bool)
    mbs = build_micro_batches(ids, lengths, wanted, 8, packed=packed)
    seen = []
    for mb in mbs:
        assert mb.num_tokens <= 8 or mb.rows.numel() == 1
        # position p's label is token p+1 of its sequence; to_rows must put it in column p+1
        rows = mb.to_rows(mb.labels.float())
        for j, row in enumerate(mb.rows.tolist()):
            n = int(lengths[row])
            assert rows[j, 1:n].tolist() == ids[row, 1:n].float().tolist()
            assert rows[j, 0] == 0 and (rows[j, n:] == 0).all()
            seen.append(row)
        assert int(mb.label_mask.sum()) == int((mb.lengths - 1).sum())
    assert sorted(seen) == [0, 1, 2, 3]


def test_packed_forward_equals_unpacked_and_hf(single_run):
    r = single_run["forward"]
    assert r["packed_vs_unpacked"] <= 1e-5, r
    assert r["packed_vs_hf"] <= 1e-5 and r["entropy_vs_hf"] <= 1e-5, r
    assert r["outside_mask_zero"]
