"""Micro-batch planning and the token-aligned round trip (single process, CP=1), and the packed forward
equal to the unpacked one and to HF (from the single-rank worker)."""
from __future__ import annotations

import random

import pytest
import torch

from megarlhf.learner import Packing, build_micro_batches, plan_micro_batches


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
    mbs = build_micro_batches(ids, lengths, wanted, Packing(8, packed=packed))
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
    # the four groups' shared prompts, less the last prompt token of each (in every branch): 4 + 6 + 1 + 2
    assert r["tokens_saved_by_sharing"] == 13, r
    assert r["packed_vs_unpacked"] <= 1e-5 and r["shared_vs_plain_packed"] <= 1e-5, r
    # bf16: sharing the prompt is no further from fp32 than packing whole (the bf16 noise itself is ~1e-2)
    bf16 = r["bf16_mean_error"]
    assert bf16["shared"] <= 1.5 * bf16["whole"] and 0 < bf16["whole"] < 0.1, bf16
    assert r["packed_vs_hf"] <= 1e-5 and r["entropy_vs_hf"] <= 1e-5, r
    assert r["outside_mask_zero"]


def _shared_prompt_batch():
    """Rows 0-2 share the prompt [1, 2, 3, 4], row 3 has its own, row 4 repeats row 3's prompt but its
    first wanted token comes later (a longer prompt), so it shares nothing with row 3."""
    seqs = [[1, 2, 3, 4, 10, 11, 12], [1, 2, 3, 4, 20, 21], [1, 2, 3, 4, 30], [5, 6, 40, 41], [5, 6, 7, 50, 51]]
    prompt = [4, 4, 4, 2, 3]
    ids = torch.zeros(5, 7, dtype=torch.long)
    wanted = torch.zeros(5, 7, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        wanted[i, prompt[i]:len(s)] = True
    return ids, torch.tensor([len(s) for s in seqs]), wanted


def test_shared_prefix_trees_round_trip_and_count_the_prompt_once():
    ids, lengths, wanted = _shared_prompt_batch()
    mbs = build_micro_batches(ids, lengths, wanted, Packing(100, share_prefixes=True))
    assert len(mbs) == 1
    mb = mbs[0]
    # rows 0-2: prefix [1, 2, 3] once, branches [4, 10, 11, 12], [4, 20, 21], [4, 30]; rows 3 and 4 whole
    assert mb.tokens[0].tolist() == [1, 2, 3, 4, 10, 11, 12, 4, 20, 21, 4, 30, 5, 6, 40, 41, 5, 6, 7, 50, 51]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3, 4]
    assert mb.packed_seq_params.prefix_of == (-1, 0, 0, 0, -1, -1)
    assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 3, 7, 10, 12, 16, 21]
    assert mb.num_tokens == int(lengths.sum()) - 2 * 3
    # every wanted label is its row's next token, and to_rows puts position t - 1's output in column t
    rows = mb.to_rows(mb.labels.float())
    wanted_rows = mb.to_rows(mb.label_mask.float()).bool()
    for j, row in enumerate(mb.rows.tolist()):
        n = int(lengths[row])
        assert wanted_rows[j].tolist() == wanted[row].tolist()
        assert rows[j][wanted[row]].tolist() == ids[row][wanted[row]].float().tolist()
        assert (rows[j, n:] == 0).all()
    # the last token's output of each row (a reward model's score)
    positions = torch.arange(mb.tokens.shape[1], dtype=torch.float32)[None]
    last = mb.last_token_outputs(positions)
    assert last.tolist() == [6.0, 9.0, 11.0, 15.0, 20.0]


@pytest.mark.parametrize("packing", [Packing(8), Packing(8, packed=False), Packing(100, share_prefixes=True),
                                     Packing(100, sequence_multiple=4), Packing(9, packed=False, sequence_multiple=2)],
                         ids=["packed", "unpacked", "shared_prefixes", "packed_sequence_parallel", "unpacked_sp"])
def test_to_positions_is_the_way_back_of_to_rows(packing):
    """Per-token [n, width, K] values (a teacher's top-k ids) go to the positions whose output predicts each token
    and come back by to_rows at every wanted token; the label of each such position is its row's next token."""
    ids, lengths, wanted = _shared_prompt_batch()
    values = torch.randint(0, 1000, (*ids.shape, 3))
    for mb in build_micro_batches(ids, lengths, wanted, packing):
        local = mb.to_positions(values[mb.rows, :mb.width])
        assert tuple(local.shape) == (*mb.tokens.shape, 3)
        back = mb.to_rows(local)
        labels = mb.to_rows(mb.labels)
        for j, row in enumerate(mb.rows.tolist()):
            keep = wanted[row, :mb.width]
            assert torch.equal(back[j][keep], values[row, :mb.width][keep])
            assert torch.equal(labels[j][keep], ids[row, :mb.width][keep])


def test_shared_prefix_trees_stay_under_the_budget():
    ids, lengths, wanted = _shared_prompt_batch()
    # 7 + (6 - 3) = 10 fills a budget of 10, so row 2 starts a tree of its own (then first-fit decreasing)
    mbs = build_micro_batches(ids, lengths, wanted, Packing(10, share_prefixes=True))
    assert [mb.rows.tolist() for mb in mbs] == [[0, 1], [2, 4], [3]]
    assert [mb.num_tokens for mb in mbs] == [10, 10, 4]
    assert mbs[0].packed_seq_params.prefix_of == (-1, 0, 0)
    assert not hasattr(mbs[1].packed_seq_params, "prefix_of")  # two unrelated sequences: plain packing
    with pytest.raises(ValueError, match="shared prefixes need packing and context parallel size 1"):
        build_micro_batches(ids, lengths, wanted, Packing(10, share_prefixes=True, packed=False))


def test_shared_prefix_groups_share_only_when_all_rows_agree():
    ids, lengths, wanted = _shared_prompt_batch()
    mbs = build_micro_batches(ids, lengths, wanted, Packing(100, share_prefixes=True),
                              groups=[[0, 1], [2, 3], [4]])
    params = mbs[0].packed_seq_params
    assert params.prefix_of == (-1, 0, 0, -1, -1, -1)  # [0, 1] share; [2, 3] and [4] are whole rows


def test_token_ids_outside_the_vocabulary_are_refused_once_per_pass():
    from megarlhf.learner import ExperienceBatch
    from megarlhf.learner.forward import check_token_ids

    batch = ExperienceBatch.from_sequences([[1, 2], [3]], [[4, 5], [6, 7]], device=torch.device("cpu"))
    mbs = build_micro_batches(batch.input_ids, batch.lengths, batch.response_mask, Packing(3, packed=True))
    assert len(mbs) == 2
    check_token_ids(mbs, vocab_size=8)
    with pytest.raises(ValueError, match=r"token ids \[7\] lie outside the model's vocabulary \[0, 7\)"):
        check_token_ids(mbs, vocab_size=7)
    check_token_ids(mbs[:1], vocab_size=6)  # the prompt's tokens are never a wanted label
