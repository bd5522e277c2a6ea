"""Rollout/trainer log-prob mismatch: truncated importance sampling, gap masking and metrics.

The rollout engine (vLLM) and the trainer (Megatron) compute different log-probs for the same tokens
(kernels, precision, batch shapes), so the samples are slightly off-policy for the trainer. With
``delta_t = trainer_logprobs_t - rollout_logprobs_t`` over response tokens:

* Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training"): token level ``w_t = min(exp(delta_t), cap)``; sequence level
  ``w_i = min(exp(sum_t delta_it), cap)`` on every response token of row i. Weights are detached
  (they are constants that multiply the per-token policy loss; ``PolicyLossInputs.rollout_is_weights``)
  and 0 on padding. They are computed in log space (``exp(min(x, log cap))``) so they cannot overflow.
* Gap masking: response tokens with ``|delta_t| > mask_threshold`` are dropped from the mask.

What the weights correct, exactly. ``exp(delta_t)`` is the ratio of the trainer's (proximal) policy to
the policy that sampled the token: kernel noise, and with ``rollout.max_staleness >= 1`` also the
updates the trainers made since the engines' weights (``megarlhf.loops.pipeline``). Untruncated,
sequence-level weights would make the policy-gradient estimate unbiased for the proximal policy;
token-level weights use the per-token ratio only (the ratios of earlier tokens are left out: lower
variance, biased). Truncation at ``cap`` is biased whenever a true ratio exceeds ``cap`` (those samples
count as if their ratio were ``cap``, i.e. the estimate leans towards the sampling policy), and so is gap
masking (masked tokens give no gradient). The bias grows with the lag; ``mismatch/is_weight_mean``
and ``mismatch/logprob_abs_diff_*`` show how far the samples are.
* Metrics over response tokens only: ``mismatch/logprob_abs_diff_max``, ``mismatch/logprob_abs_diff_mean``,
  ``mismatch/exp_abs_diff_mean`` (mean of ``exp(|delta_t|)``), ``mismatch/masked_fraction`` (share of
  response tokens removed by gap masking) and ``mismatch/is_weight_mean`` (mean TIS weight, 1 without
  TIS). They are local to the tensors given.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from megarlhf.algorithms._checks import check_mask, check_shape, masked_mean, zero_masked
from megarlhf.config.algorithm import TIS_LEVELS, MismatchConfig


@dataclass
class MismatchOutput:
    is_weights: Tensor | None  # [B, T] detached TIS weights (0 on padding), None without TIS
    response_mask: Tensor  # [B, T] bool: the response mask minus gap-masked tokens
    metrics: dict[str, Tensor] = field(default_factory=dict)


def _checked_delta(trainer_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, where: str):
    mask = check_mask(where, "mask", mask)
    check_shape(where, "trainer_logprobs", trainer_logprobs, tuple(mask.shape))
    check_shape(where, "rollout_logprobs", rollout_logprobs, tuple(mask.shape))
    delta = zero_masked(trainer_logprobs.detach(), mask) - zero_masked(rollout_logprobs.detach(), mask)
    return delta, mask


def truncated_is_weights(trainer_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor,
                         level: str, cap: float) -> Tensor:
    """Detached TIS weights [B, T] at ``level`` ("token" or "sequence"); see the module docstring."""
    delta, mask = _checked_delta(trainer_logprobs, rollout_logprobs, mask, "truncated_is_weights")
    log_cap = math.log(cap)
    if level == "token":
        log_weights = delta
    elif level == "sequence":
        log_weights = delta.sum(dim=1, keepdim=True).expand(mask.shape)
    else:
        raise ValueError(f"truncated_is_weights: level must be one of {TIS_LEVELS}, got {level!r}")
    return zero_masked(torch.exp(torch.clamp(log_weights, max=log_cap)), mask)


def logprob_gap_mask(trainer_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor,
                     threshold: float) -> Tensor:
    """``mask`` (bool) without the response tokens whose ``|trainer - rollout|`` exceeds ``threshold``."""
    delta, mask = _checked_delta(trainer_logprobs, rollout_logprobs, mask, "logprob_gap_mask")
    return mask & (delta.abs() <= threshold)


def rollout_correction(trainer_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor,
                       config: MismatchConfig) -> MismatchOutput:
    """Applies ``config``: TIS weights (if ``tis_level``), gap masking (if ``mask_threshold``), metrics."""
    delta, mask = _checked_delta(trainer_logprobs, rollout_logprobs, mask, "rollout_correction")
    weights = None
    if config.tis_level is not None:
        weights = truncated_is_weights(trainer_logprobs, rollout_logprobs, mask, config.tis_level,
                                       config.tis_cap)
    kept = mask
    if config.mask_threshold is not None:
        kept = logprob_gap_mask(trainer_logprobs, rollout_logprobs, mask, config.mask_threshold)
    abs_delta = delta.abs()
    metrics = {  # device tensors, no host read: |delta| >= 0, so the masked max is the max of zero_masked
        "mismatch/logprob_abs_diff_max": zero_masked(abs_delta, mask).amax(),
        "mismatch/logprob_abs_diff_mean": masked_mean(abs_delta, mask),
        "mismatch/exp_abs_diff_mean": masked_mean(torch.exp(abs_delta), mask),
        "mismatch/masked_fraction": masked_mean((mask & ~kept).to(delta.dtype), mask),
        "mismatch/is_weight_mean": (masked_mean(weights, mask) if weights is not None
                                    else abs_delta.new_ones(())),
    }
    return MismatchOutput(is_weights=weights, response_mask=kept, metrics=metrics)
