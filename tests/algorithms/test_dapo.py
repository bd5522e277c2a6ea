"""DAPO overlong reward shaping and the dynamic-sampling group filter against hand-worked values."""
from __future__ import annotations

import pytest
import torch

from megarlhf.config.algorithm import OverlongConfig
from megarlhf.algorithms import dynamic_sampling_filter, overlong_penalty


def test_overlong_penalty_hand_worked():
    # max 100, buffer 20, penalty 0.5: ramp starts after 80 tokens
    lengths = torch.tensor([10, 80, 81, 90, 100, 101, 500])
    penalty = overlong_penalty(lengths, 100, OverlongConfig(buffer_length=20, penalty_factor=0.5))
    expected = torch.tensor([0.0, 0.0, -0.5 * 1 / 20, -0.5 * 10 / 20, -0.5, -0.5, -0.5])
    assert torch.allclose(penalty, expected, rtol=0, atol=1e-7)


def test_overlong_errors():
    with pytest.raises(ValueError, match="OverlongConfig.buffer_length must be a positive int"):
        OverlongConfig(buffer_length=0)
    with pytest.raises(ValueError, match=r"max_length \(10\) must exceed OverlongConfig.buffer_length"):
        overlong_penalty(torch.tensor([1]), 10, OverlongConfig(buffer_length=20))


def test_dynamic_sampling_drops_constant_groups():
    # interleaved groups: 5 -> (1, 1, 1) constant; 3 -> (0, 1); 8 -> (0.5, 0.5) constant; 1 -> (2) single
    group_ids = torch.tensor([5, 3, 8, 5, 3, 8, 5, 1])
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 0.5, 1.0, 2.0])
    result = dynamic_sampling_filter(rewards, group_ids)
    assert result.kept_indices.tolist() == [1, 4]
    assert result.num_groups == 4 and result.num_groups_dropped == 3


def test_dynamic_sampling_keeps_everything_varied_and_checks_inputs():
    result = dynamic_sampling_filter(torch.tensor([0, 1, 1, 0]), torch.tensor([0, 0, 1, 1]))
    assert result.kept_indices.tolist() == [0, 1, 2, 3] and result.num_groups_dropped == 0
    with pytest.raises(ValueError, match="must both be 1-D"):
        dynamic_sampling_filter(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="non-finite"):
        dynamic_sampling_filter(torch.tensor([float("nan"), 1.0]), torch.tensor([0, 0]))
