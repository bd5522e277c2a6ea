"""ExperienceBatch: construction from token lists on a given device (token-aligned layout), validation
messages (shapes, devices), row selection."""
from __future__ import annotations

import pytest
import torch

from megarlhf.learner import ExperienceBatch


def small() -> ExperienceBatch:
    return ExperienceBatch.from_sequences([[1, 2], [3], [4, 5, 6]], [[7, 8, 9], [10, 11], [12]],
                                          device=torch.device("cpu"), pad_id=0, rollout_logprobs=[[-1.0, -2.0, -3.0], [-4.0, -5.0], [-6.0]],
                                          group_ids=[0, 0, 1])


def test_from_sequences_is_token_aligned():
    b = small()
    assert b.input_ids.tolist() == [[1, 2, 7, 8, 9], [3, 10, 11, 0, 0], [4, 5, 6, 12, 0]]
    assert b.lengths.tolist() == [5, 3, 4]
    assert b.response_mask.int().tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 0, 1, 0]]
    assert b.rollout_logprobs.tolist() == [[0, 0, -1, -2, -3], [0, -4, -5, 0, 0], [0, 0, 0, -6, 0]]
    assert b.group_ids.tolist() == [0, 0, 1]


def test_select():
    b = small()
    picked = b.select([1, 2])
    assert picked.input_ids.tolist() == [[3, 10, 11, 0], [4, 5, 6, 12]]  # trimmed to the longest
    assert picked.rollout_logprobs.shape == (2, 4) and picked.group_ids.tolist() == [0, 1]
    assert picked.device == b.device
    assert picked.host_lengths == tuple(picked.lengths.tolist()) == (3, 4)


def test_every_field_lives_on_the_batch_device():
    b = small()
    assert all(t.device == torch.device("cpu") for t in (b.input_ids, b.lengths, b.response_mask,
                                                         b.rollout_logprobs, b.group_ids))
    with pytest.raises(ValueError, match="advantages not on the batch's device cpu"):
        b.replace(advantages=torch.zeros(b.input_ids.shape, device="meta"))


def test_validation_messages():
    b = small()
    with pytest.raises(ValueError, match="response_mask marks column 0"):
        ExperienceBatch(b.input_ids, b.lengths, torch.ones_like(b.response_mask))
    with pytest.raises(ValueError, match="response_mask marks column 0"):  # a replaced mask is checked too
        b.replace(response_mask=torch.ones_like(b.response_mask))
    with pytest.raises(ValueError, match=r"lengths must lie in \[2, 5\]"):  # new lengths: checked in full
        b.replace(lengths=torch.tensor([5, 1, 4]))
    assert b.replace(lengths=b.lengths + 0).host_lengths == b.host_lengths
    with pytest.raises(ValueError, match="advantages has shape"):
        b.replace(advantages=torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"lengths must lie in \[2, 5\]"):
        ExperienceBatch(b.input_ids, torch.tensor([5, 1, 4]), b.response_mask)
    with pytest.raises(ValueError, match="rollout_logprobs\\[0\\] has 1 entries for 2 response tokens"):
        ExperienceBatch.from_sequences([[1]], [[2, 3]], device=torch.device("cpu"), rollout_logprobs=[[-1.0]])
    with pytest.raises(ValueError, match="actor_update: the experience batch has no old_logprobs, advantages"):
        b.require("actor_update", "old_logprobs", "advantages", "rollout_logprobs")
