"""DAPO's two data-side techniques: overlong reward shaping and the dynamic-sampling group filter.

Both follow Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
(sec. 3.2 dynamic sampling, sec. 3.4 overlong reward shaping). Dynamic sampling keeps generating
until the step's batch holds ``train.global_batch_size`` prompts whose samples' rewards differ; the
rounds themselves are the RL driver's (:mod:`megarlhf.loops.collect`), the group test is
:func:`dynamic_sampling_filter`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from megarlhf.config.algorithm import OverlongConfig


def overlong_penalty(response_lengths: Tensor, max_length: int, config: OverlongConfig) -> Tensor:
    """Per-sample length penalty [B] to add to the reward (DAPO eq. 13, scaled by ``penalty_factor``).

    With ``L = max_length``, ``C = buffer_length`` and ``p = penalty_factor``:
    ``0`` if ``len <= L - C``; ``-p * (len - (L - C)) / C`` if ``L - C < len <= L``; ``-p`` if ``len > L``.
    """
    if response_lengths.dim() != 1:
        raise ValueError(f"overlong_penalty: response_lengths must be 1-D [B], "
                         f"got {tuple(response_lengths.shape)}")
    if not max_length > config.buffer_length:
        raise ValueError(f"overlong_penalty: max_length ({max_length}) must exceed "
                         f"OverlongConfig.buffer_length ({config.buffer_length})")
    lengths = response_lengths.to(torch.float64)
    start = max_length - config.buffer_length
    ramp = (lengths - start) / config.buffer_length
    penalty = -config.penalty_factor * torch.clamp(ramp, min=0.0, max=1.0)
    return penalty.to(torch.float32)


@dataclass
class GroupFilterResult:
    kept_indices: Tensor  # [K] int64, ascending: samples of the groups that were kept
    num_groups: int  # groups seen
    num_groups_dropped: int  # groups whose rewards were all equal


def dynamic_sampling_filter(rewards: Tensor, group_ids: Tensor) -> GroupFilterResult:
    """DAPO dynamic sampling: drops every group (samples sharing a prompt id, in any order) whose
    rewards are all exactly equal, since such a group has zero group-relative advantage and gives no
    gradient; returns the indices of the samples of the remaining groups.
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"dynamic_sampling_filter: rewards {tuple(rewards.shape)} and group_ids "
                         f"{tuple(group_ids.shape)} must both be 1-D [B]")
    if group_ids.is_floating_point():
        raise ValueError(f"dynamic_sampling_filter: group_ids must be integers, got {group_ids.dtype}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("dynamic_sampling_filter: rewards contain non-finite values")
    rewards = rewards.to(torch.float64)
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = unique.numel()
    lows = torch.full((num_groups,), float("inf"), dtype=rewards.dtype, device=rewards.device)
    highs = torch.full((num_groups,), float("-inf"), dtype=rewards.dtype, device=rewards.device)
    lows = lows.scatter_reduce(0, inverse, rewards, reduce="amin")
    highs = highs.scatter_reduce(0, inverse, rewards, reduce="amax")
    varied = highs > lows
    kept = varied[inverse].nonzero().flatten()
    return GroupFilterResult(kept_indices=kept, num_groups=num_groups,
                             num_groups_dropped=int((~varied).sum()))
