"""Advantage estimators: rewards (and optionally critic values) -> per-token advantages and returns.

Every estimator is registered in :data:`ADVANTAGE_ESTIMATORS` with one signature::

    estimator(inputs: AdvantageInputs, config: AdvantageConfig, dp_group=None) -> AdvantageOutputs

and declares what it needs from the run (:class:`EstimatorNeeds`: a trained critic, groups of at least
two samples per prompt, a greedy baseline response per prompt). The config validation, the RL driver
and the memory planner read that declaration (``ADVANTAGE_ESTIMATORS.get(name).needs``) and nothing
else: adding an estimator touches this file only.

One signature for every estimator, groups by prompt id, padding masked: unlike verl's and OpenRLHF's, which
give each estimator its own signature and group samples by position.

Conventions shared by all estimators (B samples, T response positions):

* The per-token reward is ``r[i, t] = token_rewards[i, t] + rewards[i] * [t == last_i]``, where
  ``last_i`` is the last response position of row ``i`` (the sequence reward sits on the final token;
  token rewards, e.g. a KL penalty, add on top). Sequence-level estimators use the sequence return
  ``R_i = rewards[i] + sum_t mask[i, t] * token_rewards[i, t]``.
* Only positions with ``response_mask == 1`` are read; outputs are 0 elsewhere. A recursion over time
  skips masked-out positions (the next step of a token is the next response token of its row).
* Samples are grouped by ``group_ids`` (prompt ids), in any order and with unequal group sizes. Every
  group must be whole on this rank: group statistics are not reduced over data-parallel ranks.
* Global whitening ``w(x) = (x - mean) / (std + eps)`` uses the population mean and standard deviation
  over response tokens; with ``dp_group`` they are taken over the response tokens of every rank of the
  group (sums all-reduced), so each rank whitens with the statistics of the global batch.
* Critic-free estimators return ``returns[i, t] = R_i`` on response tokens (the Monte-Carlo target of
  the sequence); GAE returns ``advantage + value`` (the lambda-return), before any whitening;
  REINFORCE++ variants return their discounted token returns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from megarlhf.algorithms._checks import (all_reduce_sum, check_mask, check_shape, compute_dtype,
                                         zero_masked)
from megarlhf.core.registry import Registry
from megarlhf.config.algorithm import AdvantageConfig


@dataclass
class AdvantageInputs:
    """What an estimator reads; see the module docstring for how each field is used."""

    rewards: Tensor  # [B] sequence-level scalar rewards
    response_mask: Tensor  # [B, T] 1 on response tokens
    token_rewards: Tensor | None = None  # [B, T] per-token rewards added on top (e.g. -beta * KL)
    values: Tensor | None = None  # [B, T] critic values (GAE)
    group_ids: Tensor | None = None  # [B] integer prompt ids
    baseline_rewards: Tensor | None = None  # [B] reward of the greedy sample (ReMax)

    def __post_init__(self):
        where = "AdvantageInputs"
        if not isinstance(self.rewards, Tensor) or self.rewards.dim() != 1:
            raise ValueError(f"{where}: rewards must be a 1-D [B] tensor")
        self.response_mask = check_mask(where, "response_mask", self.response_mask)
        batch, length = self.response_mask.shape
        check_shape(where, "rewards", self.rewards, (batch,))
        check_shape(where, "token_rewards", self.token_rewards, (batch, length))
        check_shape(where, "values", self.values, (batch, length))
        check_shape(where, "group_ids", self.group_ids, (batch,))
        check_shape(where, "baseline_rewards", self.baseline_rewards, (batch,))
        if self.group_ids is not None and self.group_ids.is_floating_point():
            raise ValueError(f"{where}: group_ids must be an integer tensor, got {self.group_ids.dtype}")
        empty = (~self.response_mask.any(dim=1)).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"{where}: rows {empty} of response_mask have no response token")
        for name in ("rewards", "baseline_rewards"):
            tensor = getattr(self, name)
            if tensor is not None and not bool(torch.isfinite(tensor).all()):
                bad = (~torch.isfinite(tensor)).nonzero().flatten().tolist()
                raise ValueError(f"{where}: {name} is not finite at rows {bad}")


@dataclass
class AdvantageOutputs:
    advantages: Tensor  # [B, T], 0 on masked positions
    returns: Tensor  # [B, T], 0 on masked positions


@dataclass(frozen=True)
class EstimatorNeeds:
    """What an estimator needs the RL step to provide besides rewards and the response mask."""

    critic: bool = False  # AdvantageInputs.values from a critic trained alongside the actor (PPO's GAE)
    groups: bool = False  # compares the samples of one prompt: rollout.n_samples >= 2 and group_ids
    greedy_baseline: bool = False  # AdvantageInputs.baseline_rewards: the reward of one greedy response
    rewards: bool = True  # learns from the rewards (``none``, for distillation alone, does not)


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: the function and what it needs; calling it calls the function."""

    fn: Callable[[AdvantageInputs, AdvantageConfig, object], AdvantageOutputs]
    needs: EstimatorNeeds

    def __call__(self, inputs: AdvantageInputs, config: AdvantageConfig, dp_group=None) -> AdvantageOutputs:
        return self.fn(inputs, config, dp_group=dp_group)


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def estimator_needs(name: str) -> EstimatorNeeds:
    """What the estimator registered as ``name`` declared it needs from the run."""
    return ADVANTAGE_ESTIMATORS.get(name).needs


def _estimator(name: str, **needs: bool):
    """Registers the decorated function under ``name`` with its :class:`EstimatorNeeds`."""
    def add(fn):
        ADVANTAGE_ESTIMATORS.register(name)(AdvantageEstimator(fn, EstimatorNeeds(**needs)))
        return fn

    return add


# ---------------------------------------------------------------------------------------------- helpers

def _require(inputs: AdvantageInputs, field: str, estimator: str) -> Tensor:
    tensor = getattr(inputs, field)
    if tensor is None:
        raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInputs.{field}, which is None")
    return tensor


def _token_reward_matrix(inputs: AdvantageInputs, rewards: Tensor, dtype: torch.dtype) -> Tensor:
    """r[i, t]: masked token rewards plus ``rewards[i]`` on the last response token of row i."""
    mask = inputs.response_mask
    r = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    if inputs.token_rewards is not None:
        r = zero_masked(inputs.token_rewards.detach().to(dtype), mask)
    length = mask.shape[1]
    last = length - 1 - mask.flip(dims=[1]).int().argmax(dim=1)
    rows = torch.arange(mask.shape[0], device=mask.device)
    r[rows, last] = r[rows, last] + rewards.detach().to(dtype)
    return r


def _sequence_returns(inputs: AdvantageInputs, dtype: torch.dtype) -> Tensor:
    """R_i = rewards[i] + sum of row i's masked token rewards."""
    total = inputs.rewards.detach().to(dtype)
    if inputs.token_rewards is not None:
        total = total + zero_masked(inputs.token_rewards.detach().to(dtype), inputs.response_mask).sum(dim=1)
    return total


def _broadcast(per_sequence: Tensor, mask: Tensor) -> Tensor:
    """[B] -> [B, T]: the sequence value on every response token, 0 elsewhere."""
    return zero_masked(per_sequence[:, None].expand(mask.shape), mask)


def _discounted_returns(r: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G[i, t] = r[i, t] + gamma * G[i, next response token of row i after t] (0 past the last)."""
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in reversed(range(r.shape[1])):
        m = mask[:, t]
        running = torch.where(m, r[:, t] + gamma * running, running)
        out[:, t] = torch.where(m, running, torch.zeros_like(running))
    return out


def _group_index(group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(unique ids, index of each sample's group, group sizes)."""
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    counts = torch.bincount(inverse, minlength=unique.numel())
    return unique, inverse, counts


def _group_sum(x: Tensor, inverse: Tensor, counts: Tensor) -> Tensor:
    return torch.zeros(counts.numel(), dtype=x.dtype, device=x.device).index_add_(0, inverse, x)


def _group_mean(x: Tensor, inverse: Tensor, counts: Tensor) -> Tensor:
    return _group_sum(x, inverse, counts) / counts.to(x.dtype)


def _whiten(x: Tensor, mask: Tensor, eps: float, dp_group) -> Tensor:
    """(x - mean) / (std + eps) over masked tokens of the whole ``dp_group`` (population std)."""
    values = zero_masked(x, mask)
    stats = torch.stack([values.sum(), mask.sum().to(x.dtype)])
    total, count = all_reduce_sum(stats, dp_group).unbind()
    mean = total / count
    # Two passes (mean, then squared deviations) rather than E[x^2] - E[x]^2, which cancels badly.
    sq_dev = all_reduce_sum(zero_masked((x - mean) ** 2, mask).sum(), dp_group)
    std = torch.sqrt(sq_dev / count)
    return zero_masked((x - mean) / (std + eps), mask)


# ------------------------------------------------------------------------------------------- estimators

@_estimator("gae", critic=True)
def gae(inputs: AdvantageInputs, config: AdvantageConfig, dp_group=None) -> AdvantageOutputs:
    """Generalized Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control
    Using Generalized Advantage Estimation"; as used by PPO, Schulman et al. 2017).

    Over response tokens of a row, with V past the last token = 0 and A past the last token = 0:
    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``,
    ``returns_t = A_t + V_t``. If ``config.gae_whiten``, the advantages are then whitened over the
    global batch (module docstring); returns are not.
    """
    values_in = _require(inputs, "values", "gae")
    mask = inputs.response_mask
    dtype = compute_dtype(inputs.rewards, inputs.token_rewards, values_in)
    r = _token_reward_matrix(inputs, inputs.rewards, dtype)
    values = zero_masked(values_in.detach().to(dtype), mask)
    advantages = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], dtype=dtype, device=r.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(r.shape[1])):
        m = mask[:, t]
        delta = r[:, t] + config.gamma * next_value - values[:, t]
        adv_t = delta + config.gamma * config.lam * next_adv
        advantages[:, t] = torch.where(m, adv_t, torch.zeros_like(adv_t))
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, adv_t, next_adv)
    returns = zero_masked(advantages + values, mask)
    if config.gae_whiten:
        advantages = _whiten(advantages, mask, config.eps, dp_group)
    return AdvantageOutputs(advantages=advantages, returns=returns)


def _grpo_like(inputs: AdvantageInputs, config: AdvantageConfig, name: str, divide_by_std: bool):
    group_ids = _require(inputs, "group_ids", name)
    seq_return = _sequence_returns(inputs, compute_dtype(inputs.rewards, inputs.token_rewards))
    _, inverse, counts = _group_index(group_ids)
    centered = seq_return - _group_mean(seq_return, inverse, counts)[inverse]
    if divide_by_std:
        sq = _group_sum(centered ** 2, inverse, counts)
        # Bessel-corrected std as in DeepSeekMath's reference code; a group of one has std 0
        # (its centred reward is 0 anyway).
        var = torch.where(counts > 1, sq / (counts - 1).clamp(min=1).to(sq.dtype), torch.zeros_like(sq))
        centered = centered / (torch.sqrt(var)[inverse] + config.eps)
    mask = inputs.response_mask
    return AdvantageOutputs(advantages=_broadcast(centered, mask), returns=_broadcast(seq_return, mask))


@_estimator("grpo", groups=True)
def grpo(inputs: AdvantageInputs, config: AdvantageConfig, dp_group=None) -> AdvantageOutputs:
    """GRPO outcome supervision (Shao et al. 2024, "DeepSeekMath", sec. 4.1.2).

    ``A_i = (R_i - mean_g(R)) / (std_g(R) + eps)`` on every response token of sample i, where g is
    the group of samples sharing i's prompt id and std_g is Bessel-corrected (std of a single-sample
    group is 0). ``dp_group`` is unused: groups are whole on a rank.
    """
    return _grpo_like(inputs, config, "grpo", divide_by_std=True)


@_estimator("dr_grpo", groups=True)
def dr_grpo(inputs: AdvantageInputs, config: AdvantageConfig, dp_group=None) -> AdvantageOutputs:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"):
    GRPO without the std division, ``A_i = R_i - mean_g(R)`` on every response token of sample i.
    (The paper's other change, a constant length normaliser, is the ``seq_mean_token_sum_norm``
    aggregation mode.)
    """
    return _grpo_like(inputs, config, "dr_grpo", divide_by_std=False)


@_estimator("rloo", groups=True)
def rloo(inputs: AdvantageInputs, config: AdvantageConfig, dp_group=None) -> AdvantageOutputs:
    """RLOO (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs"): leave-one-out baseline within the prompt's group,
    ``A_i = R_i - (sum_{j in g, j != i} R_j) / (n_g - 1)`` on every response token of sample i.
    Every group needs at least two samples.
    """
    group_ids = _require(inputs, "group_ids", "rloo")
    seq_return = _sequence_returns(inputs, compute_dtype(inputs.rewards, inputs.token_rewards))
    unique, inverse, counts = _group_index(group_ids)
    if bool((counts < 2).any()):
        single = unique[counts < 2].tolist()
        raise ValueError(f"rloo needs at least 2 samples per group; groups {single} have one")
    sums = _group_sum(seq_return, inverse, counts)
    others_mean = (sums[inverse] - seq_return) / (counts[inverse] - 1).to(seq_return.dtype)
    mask = inputs.response_mask
    return AdvantageOutputs(advantages=_broadcast(seq_return - others_mean, mask),
                            returns=_broadcast(seq_return, mask))


@_estimator("remax", greedy_baseline=True)
def remax(inputs: AdvantageInputs, config: AdvantageConfig, dp_group=None) -> AdvantageOutputs:
    """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method
    for Aligning Large Language Models"): the reward of the greedy response to the same prompt is the
    baseline, ``A_i = R_i - baseline_rewards[i]`` on every response token of sample i.
    """
    baseline = _require(inputs, "baseline_rewards", "remax")
    seq_return = _sequence_returns(inputs, compute_dtype(inputs.rewards, inputs.token_rewards, baseline))
    mask = inputs.response_mask
    return AdvantageOutputs(advantages=_broadcast(seq_return - baseline.detach().to(seq_return.dtype), mask),
                            returns=_broadcast(seq_return, mask))


@_estimator("reinforce_pp")
def reinforce_pp(inputs: AdvantageInputs, config: AdvantageConfig, dp_group=None) -> AdvantageOutputs:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models"): discounted token returns ``G_t = r_t + gamma * G_{t+1}``, advantages ``w(G)`` whitened
    over the response tokens of the global batch (all ranks of ``dp_group``); returns are ``G``.
    """
    mask = inputs.response_mask
    r = _token_reward_matrix(inputs, inputs.rewards, compute_dtype(inputs.rewards, inputs.token_rewards))
    returns = _discounted_returns(r, mask, config.gamma)
    return AdvantageOutputs(advantages=_whiten(returns, mask, config.eps, dp_group), returns=returns)


@_estimator("reinforce_pp_baseline", groups=True)
def reinforce_pp_baseline(inputs: AdvantageInputs, config: AdvantageConfig,
                          dp_group=None) -> AdvantageOutputs:
    """REINFORCE++-baseline (Hu 2025, REINFORCE++ paper): the group mean of the sequence rewards is
    subtracted first, ``rewards'_i = rewards_i - mean_g(rewards)``, then token returns
    ``G_t = r'_t + gamma * G_{t+1}`` (token rewards added as usual) are whitened over the global batch
    as in ``reinforce_pp``; returns are ``G``.
    """
    group_ids = _require(inputs, "group_ids", "reinforce_pp_baseline")
    mask = inputs.response_mask
    dtype = compute_dtype(inputs.rewards, inputs.token_rewards)
    rewards = inputs.rewards.detach().to(dtype)
    _, inverse, counts = _group_index(group_ids)
    centered = rewards - _group_mean(rewards, inverse, counts)[inverse]
    returns = _discounted_returns(_token_reward_matrix(inputs, centered, dtype), mask, config.gamma)
    return AdvantageOutputs(advantages=_whiten(returns, mask, config.eps, dp_group), returns=returns)


@_estimator("none", rewards=False)
def no_advantage(inputs: AdvantageInputs, config: AdvantageConfig, dp_group=None) -> AdvantageOutputs:
    """No task advantage: 0 on every token (returns 0). The run learns only from what is added to the
    advantages or the loss besides the rewards (``algorithm.distill``: a teacher); the rewards are still
    computed and logged, so a verifier can watch what distillation does to accuracy.
    """
    zeros = torch.zeros(inputs.response_mask.shape, dtype=compute_dtype(inputs.rewards),
                        device=inputs.response_mask.device)
    return AdvantageOutputs(advantages=zeros, returns=zeros.clone())
