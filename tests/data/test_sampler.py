"""PromptSampler: resume equivalence across an epoch boundary, DP sharding, epochs are permutations."""
from __future__ import annotations

import pytest

from megarlhf.data import PromptSampler

N, B = 10, 4  # batches straddle the epoch boundaries (10 is not a multiple of 4)


def test_resume_mid_epoch_gives_the_same_sequence():
    reference = PromptSampler(N, B, seed=3)
    uninterrupted = [reference.next_global_batch() for _ in range(8)]
    first = PromptSampler(N, B, seed=3)
    resumed = [first.next_global_batch() for _ in range(2)]  # stop inside epoch 0
    state = first.state_dict()
    second = PromptSampler(N, B, seed=3)
    second.load_state_dict(state)
    resumed += [second.next_global_batch() for _ in range(6)]  # crosses epochs 0->1->2->3
    assert resumed == uninterrupted
    assert second.epoch == 3


def test_epochs_are_seeded_permutations():
    sampler = PromptSampler(N, 5, seed=0)
    stream = [i for _ in range(6) for i in sampler.next_global_batch()]
    epochs = [stream[k * N:(k + 1) * N] for k in range(3)]
    assert all(sorted(e) == list(range(N)) for e in epochs)
    assert epochs[0] != epochs[1]
    assert PromptSampler(N, 5, seed=1).next_global_batch() != epochs[0][:5]
    ordered = PromptSampler(N, 4, seed=0, shuffle=False)
    assert [ordered.next_global_batch() for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


@pytest.mark.parametrize("num_examples, dp_size", [(16, 2), (16, 4), (N, 2)])
def test_dp_shards_are_disjoint_and_make_the_global_batch(num_examples, dp_size):
    batch = 8
    reference = PromptSampler(num_examples, batch, seed=5)
    ranks = [PromptSampler(num_examples, batch, seed=5, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    for _ in range(5):
        global_batch = reference.next_global_batch()
        shares = [r.next_batch() for r in ranks]
        assert all(len(s) == batch // dp_size for s in shares)
        assert [i for share in shares for i in share] == global_batch  # rank order = global order
        if num_examples % batch == 0:  # no batch straddles an epoch: its indices are distinct
            assert len(set(global_batch)) == batch
            assert all(set(a).isdisjoint(b) for i, a in enumerate(shares) for b in shares[i + 1:])
            assert set().union(*shares) == set(global_batch)


def test_resume_with_another_dp_size():
    one = PromptSampler(N, B, seed=2)
    one.next_global_batch()
    want = one.next_global_batch()
    two = [PromptSampler(N, B, seed=2, dp_rank=r, dp_size=2) for r in range(2)]
    state = PromptSampler(N, B, seed=2)
    state.next_global_batch()
    for s in two:
        s.load_state_dict(state.state_dict())
    assert two[0].next_batch() + two[1].next_batch() == want


def test_bad_state_and_arguments():
    sampler = PromptSampler(N, B, seed=1)
    with pytest.raises(ValueError, match="saved seed is 2 but this sampler's is 1"):
        sampler.load_state_dict({**sampler.state_dict(), "seed": 2})
    with pytest.raises(ValueError, match="saved num_examples is 11"):
        sampler.load_state_dict({**sampler.state_dict(), "num_examples": 11})
    with pytest.raises(ValueError, match="multiple of the data-parallel size 3"):
        PromptSampler(N, 4, seed=0, dp_size=3)
    with pytest.raises(ValueError, match="empty"):
        PromptSampler(0, 4, seed=0)
