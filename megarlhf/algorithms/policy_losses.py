"""Per-token policy losses, the PPO value loss and the entropy bonus.

Every policy loss is registered in :data:`POLICY_LOSSES` with one signature::

    loss_fn(inputs: PolicyLossInputs, config: PolicyLossConfig) -> LossOutput

``LossOutput.loss`` is the per-token loss [B, T] (0 on masked positions) that the trainer reduces with
:func:`megarlhf.algorithms.aggregation.aggregate_loss`; reduction is deliberately not done here so that
every loss works with every aggregation mode. ``LossOutput.metrics`` are detached scalars averaged over
this call's response tokens: ``policy/clip_fraction`` (tokens whose gradient the clip removed, or for
CISPO whose IS weight was clipped) and ``policy/ppo_kl`` (mean of ``old_logprobs - logprobs``, the k1
estimate of KL(old || new)).

Notation: ``log_ratio = logprobs - old_logprobs``, ``ratio = exp(log_ratio)``, ``A`` = advantages.
Old log-probs, advantages and rollout IS weights are treated as constants (detached). If
``rollout_is_weights`` is given (truncated importance sampling, see ``mismatch.py``) the per-token loss
is multiplied by it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from megarlhf.algorithms._checks import check_mask, check_shape, masked_mean, zero_masked
from megarlhf.core.registry import Registry
from megarlhf.config.algorithm import PolicyLossConfig


@dataclass
class PolicyLossInputs:
    logprobs: Tensor  # [B, T] log-probs of the sampled tokens under the current policy (with grad)
    old_logprobs: Tensor  # [B, T] log-probs under the policy that the advantages were computed for
    advantages: Tensor  # [B, T]
    response_mask: Tensor  # [B, T] 1 on response tokens
    rollout_is_weights: Tensor | None = None  # [B, T] truncated IS weights (mismatch.py), detached

    def __post_init__(self):
        self.response_mask = check_mask("PolicyLossInputs", "response_mask", self.response_mask)
        shape = tuple(self.response_mask.shape)
        for name in ("logprobs", "old_logprobs", "advantages", "rollout_is_weights"):
            check_shape("PolicyLossInputs", name, getattr(self, name), shape)


@dataclass
class LossOutput:
    loss: Tensor  # [B, T] per-token loss, 0 on masked positions
    metrics: dict[str, Tensor] = field(default_factory=dict)  # detached scalars


PolicyLoss = Callable[[PolicyLossInputs, PolicyLossConfig], LossOutput]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def _sanitised(inputs: PolicyLossInputs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(mask, logprobs, old_logprobs, advantages) with padding zeroed before any arithmetic."""
    mask = inputs.response_mask
    logprobs = zero_masked(inputs.logprobs, mask)
    old = zero_masked(inputs.old_logprobs.detach(), mask)
    advantages = zero_masked(inputs.advantages.detach(), mask)
    return mask, logprobs, old, advantages


def _finish(inputs: PolicyLossInputs, loss: Tensor, clipped: Tensor, log_ratio: Tensor,
            extra: dict[str, Tensor] | None = None) -> LossOutput:
    """Applies rollout IS weights and the mask; adds the shared metrics."""
    mask = inputs.response_mask
    if inputs.rollout_is_weights is not None:
        loss = loss * zero_masked(inputs.rollout_is_weights.detach().to(loss.dtype), mask)
    metrics = {
        "policy/clip_fraction": masked_mean(clipped.to(loss.dtype), mask).detach(),
        "policy/ppo_kl": masked_mean(-log_ratio, mask).detach(),
        **(extra or {}),
    }
    return LossOutput(loss=zero_masked(loss, mask), metrics=metrics)


def _clipped_surrogate(log_ratio: Tensor, advantages: Tensor, low: float, high: float):
    """PPO's pessimistic surrogate ``max(-A r, -A clip(r, 1 - low, 1 + high))`` and where it clipped."""
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(inputs: PolicyLossInputs, config: PolicyLossConfig) -> LossOutput:
    """PPO's clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms") with
    asymmetric bounds and an optional dual clip; one loss covers the three variants:

    ``l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_eps_low, 1 + clip_eps_high))``

    * PPO: ``clip_eps_low = clip_eps_high`` (0.2);
    * clip-higher (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"):
      ``clip_eps_high > clip_eps_low`` (0.28 vs 0.2);
    * dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
      Learning"), when ``dual_clip_c = c`` is set: for ``A_t < 0``, ``loss_t = min(l_t, -c A_t)``;
      ``A_t >= 0`` keeps ``l_t``. Extra metric ``policy/dual_clip_fraction``: tokens where ``-c A`` won.

    ``policy/clip_fraction`` counts tokens whose gradient either clip removed.
    """
    mask, logprobs, old, advantages = _sanitised(inputs)
    log_ratio = logprobs - old
    loss, clipped = _clipped_surrogate(log_ratio, advantages, config.clip_eps_low, config.clip_eps_high)
    if config.dual_clip_c is None:
        return _finish(inputs, loss, clipped, log_ratio)
    bound = -config.dual_clip_c * advantages
    dual = (advantages < 0) & (bound < loss)
    loss = torch.where(dual, bound, loss)
    extra = {"policy/dual_clip_fraction": masked_mean(dual.to(loss.dtype), mask).detach()}
    return _finish(inputs, loss, clipped | dual, log_ratio, extra)


@POLICY_LOSSES.register("gspo")
def gspo(inputs: PolicyLossInputs, config: PolicyLossConfig) -> LossOutput:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), in its GSPO-token form.

    Sequence ratio ``s_i = exp(sum_t m_it (logprobs_it - old_it) / |y_i|)`` (length-normalised);
    token ratio ``s_it = sg(s_i) * pi(y_it) / sg(pi(y_it))`` (value ``s_i``, gradient
    ``s_i * grad logprobs_it``); ``loss_it = max(-A_it s_it, -A_it clip(s_it, 1 - gspo_eps_low,
    1 + gspo_eps_high))``. With advantages constant over a sequence and the ``seq_mean_token_mean``
    aggregation this is exactly the paper's sequence-level objective and gradient
    ``-(1/G) sum_i A_i s_i (1/|y_i|) sum_t grad logprobs_it`` (unclipped sequences).
    """
    mask, logprobs, old, advantages = _sanitised(inputs)
    lengths = mask.sum(dim=1).clamp(min=1).to(logprobs.dtype)
    seq_log_ratio = (logprobs - old).sum(dim=1) / lengths
    token_log_ratio = seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach()
    loss, clipped = _clipped_surrogate(token_log_ratio, advantages, config.gspo_eps_low,
                                       config.gspo_eps_high)
    return _finish(inputs, loss, clipped, logprobs - old)


@POLICY_LOSSES.register("cispo")
def cispo(inputs: PolicyLossInputs, config: PolicyLossConfig) -> LossOutput:
    """CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention"): ``loss_t = -sg(clip(r_t, 1 - cispo_eps_low, 1 + cispo_eps_high)) * A_t * logprobs_t``
    (no floor when ``cispo_eps_low`` is None). The gradient is ``-clip(r_t) A_t grad logprobs_t``: no
    token loses its gradient, only its weight is capped. ``policy/clip_fraction`` counts tokens whose
    weight was clipped.
    """
    mask, logprobs, old, advantages = _sanitised(inputs)
    log_ratio = logprobs - old
    ratio = torch.exp(log_ratio.detach())
    low = None if config.cispo_eps_low is None else 1.0 - config.cispo_eps_low
    weight = torch.clamp(ratio, min=low, max=1.0 + config.cispo_eps_high)
    loss = -weight * advantages * logprobs
    return _finish(inputs, loss, weight != ratio, log_ratio)


@POLICY_LOSSES.register("vanilla_pg")
def vanilla_pg(inputs: PolicyLossInputs, config: PolicyLossConfig) -> LossOutput:
    """REINFORCE policy gradient (Williams 1992): ``loss_t = -A_t * logprobs_t``, no ratio, no clip
    (on-policy only; ``policy/clip_fraction`` is 0).
    """
    mask, logprobs, old, advantages = _sanitised(inputs)
    loss = -advantages * logprobs
    return _finish(inputs, loss, torch.zeros_like(mask), logprobs - old)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip_range: float | None) -> LossOutput:
    """PPO critic loss, per token (0 on masked positions), with optional value clipping.

    Without clipping ``loss_t = 0.5 (V_t - R_t)^2``. With ``clip_range = c``:
    ``V'_t = old_t + clip(V_t - old_t, -c, c)`` and ``loss_t = 0.5 max((V_t - R_t)^2, (V'_t - R_t)^2)``
    (the clipped form of the PPO reference implementation, openai/baselines ppo2). Metric
    ``value/clip_fraction``: tokens where the clipped term is the larger.
    """
    mask = check_mask("value_loss", "mask", mask)
    for name, tensor in (("values", values), ("old_values", old_values), ("returns", returns)):
        check_shape("value_loss", name, tensor, tuple(mask.shape))
    if clip_range is not None and not clip_range > 0:
        raise ValueError(f"value_loss: clip_range must be > 0 or None, got {clip_range}")
    values = zero_masked(values, mask)
    old = zero_masked(old_values.detach(), mask)
    targets = zero_masked(returns.detach(), mask)
    unclipped = (values - targets) ** 2
    if clip_range is None:
        loss, clipped = 0.5 * unclipped, torch.zeros_like(mask)
    else:
        clipped_values = old + torch.clamp(values - old, -clip_range, clip_range)
        clipped_sq = (clipped_values - targets) ** 2
        loss, clipped = 0.5 * torch.maximum(unclipped, clipped_sq), clipped_sq > unclipped
    metrics = {"value/clip_fraction": masked_mean(clipped.to(loss.dtype), mask).detach()}
    return LossOutput(loss=zero_masked(loss, mask), metrics=metrics)


def entropy_bonus(entropy: Tensor, mask: Tensor, coef: float) -> Tensor:
    """Per-token entropy bonus as a loss term, ``-coef * entropy_t`` (0 on masked positions); add it to
    a policy loss before aggregation so that minimising the loss raises the entropy.
    """
    mask = check_mask("entropy_bonus", "mask", mask)
    check_shape("entropy_bonus", "entropy", entropy, tuple(mask.shape))
    return -coef * zero_masked(entropy, mask)
