"""Per-token KL(pi || pi_ref) estimators, and their two uses: a reward penalty or a loss term.

Every estimator is registered in :data:`KL_ESTIMATORS` with one signature::

    kl(logprobs: Tensor, ref_logprobs: Tensor, config: KLConfig) -> Tensor  # [B, T]

The inputs are the log-probs of the sampled tokens (sampled from pi) under the policy and under the
reference model. With ``d = clamp(logprobs - ref_logprobs, -log_ratio_limit, log_ratio_limit)``
(Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html, with
``r = pi_ref / pi = exp(-d)``):

* ``k1 = d``                      unbiased, high variance, can be negative
* ``k2 = d^2 / 2``                biased, low variance, always >= 0
* ``k3 = exp(-d) - 1 + d``        unbiased, low variance, always >= 0

The result is then clamped to ``[clamp_min, clamp_max]`` (None: no bound). Limiting ``d`` first keeps
``exp(-d)`` finite, so the gradient of a clamped k3 is 0 rather than ``0 * inf = NaN``.

The estimators are elementwise and read every position; :func:`kl_reward_penalty` and :func:`kl_loss`
take the response mask and zero padding before computing.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from megarlhf.algorithms._checks import check_mask, check_shape, zero_masked
from megarlhf.core.registry import Registry
from megarlhf.config.algorithm import KLConfig

KLEstimator = Callable[[Tensor, Tensor, "KLConfig"], Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


def _log_ratio(logprobs: Tensor, ref_logprobs: Tensor, config: KLConfig) -> Tensor:
    return torch.clamp(logprobs - ref_logprobs, -config.log_ratio_limit, config.log_ratio_limit)


def _clamp(kl: Tensor, config: KLConfig) -> Tensor:
    if config.clamp_min is None and config.clamp_max is None:
        return kl
    return torch.clamp(kl, min=config.clamp_min, max=config.clamp_max)


@KL_ESTIMATORS.register("k1")
def k1(logprobs: Tensor, ref_logprobs: Tensor, config: KLConfig) -> Tensor:
    """``k1 = log pi - log pi_ref`` (Schulman 2020), then clamped."""
    return _clamp(_log_ratio(logprobs, ref_logprobs, config), config)


@KL_ESTIMATORS.register("k2")
def k2(logprobs: Tensor, ref_logprobs: Tensor, config: KLConfig) -> Tensor:
    """``k2 = (log pi - log pi_ref)^2 / 2`` (Schulman 2020), then clamped."""
    return _clamp(0.5 * _log_ratio(logprobs, ref_logprobs, config) ** 2, config)


@KL_ESTIMATORS.register("k3")
def k3(logprobs: Tensor, ref_logprobs: Tensor, config: KLConfig) -> Tensor:
    """``k3 = pi_ref / pi - 1 - log(pi_ref / pi)`` (Schulman 2020), then clamped."""
    d = _log_ratio(logprobs, ref_logprobs, config)
    return _clamp(torch.exp(-d) - 1.0 + d, config)


def _masked_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, config: KLConfig, where: str):
    mask = check_mask(where, "mask", mask)
    check_shape(where, "logprobs", logprobs, tuple(mask.shape))
    check_shape(where, "ref_logprobs", ref_logprobs, tuple(mask.shape))
    estimate = KL_ESTIMATORS.get(config.estimator)(
        zero_masked(logprobs, mask), zero_masked(ref_logprobs.detach(), mask), config)
    return zero_masked(estimate, mask), mask


def kl_reward_penalty(token_rewards: Tensor | None, logprobs: Tensor, ref_logprobs: Tensor,
                      mask: Tensor, config: KLConfig) -> Tensor:
    """KL as a reward: ``token_rewards - coef * kl`` on response tokens, 0 elsewhere (detached).

    ``token_rewards`` may be None (no other token rewards). The result is the
    ``AdvantageInputs.token_rewards`` of the advantage estimators.
    """
    kl, mask = _masked_kl(logprobs.detach(), ref_logprobs, mask, config, "kl_reward_penalty")
    penalty = -config.coef * kl
    if token_rewards is None:
        return penalty
    check_shape("kl_reward_penalty", "token_rewards", token_rewards, tuple(mask.shape))
    return penalty + zero_masked(token_rewards.detach().to(penalty.dtype), mask)


def kl_loss(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, config: KLConfig) -> Tensor:
    """KL as a loss term: ``coef * kl`` per token [B, T] (0 on padding), differentiable in
    ``logprobs``; add it to the per-token policy loss before aggregation.
    """
    kl, _ = _masked_kl(logprobs, ref_logprobs, mask, config, "kl_loss")
    return config.coef * kl
