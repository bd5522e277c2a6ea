"""Policy losses, value loss and entropy bonus against hand-worked per-token values and hand-derived
gradients (CISPO's stop-gradient weight, GSPO's sequence ratio), plus properties: dual clip bounds
the loss for negative advantages, clip-higher uses both bounds it is given and combines with the dual
clip in the one ppo_clip loss, padding never leaks."""
from __future__ import annotations

import math

import pytest
import torch

from megarlhf.algorithms import (POLICY_LOSSES, PolicyLossInputs, aggregate_loss, compute_normaliser, entropy_bonus,
                                 value_loss)
from megarlhf.config.algorithm import PolicyLossConfig

NAN = float("nan")


def _case(ratios, advantages, old=-1.0):
    """One row of tokens whose ratio pi/pi_old is exactly ``ratios``; returns (inputs, logprobs leaf)."""
    old_lp = torch.full((1, len(ratios)), old, dtype=torch.float64)
    logprobs = (old_lp + torch.log(torch.tensor([ratios], dtype=torch.float64))).requires_grad_(True)
    inputs = PolicyLossInputs(logprobs=logprobs, old_logprobs=old_lp,
                              advantages=torch.tensor([advantages], dtype=torch.float64),
                              response_mask=torch.ones(1, len(ratios), dtype=torch.bool))
    return inputs, logprobs


def _run(name, inputs, logprobs, **config):
    out = POLICY_LOSSES.get(name)(inputs, PolicyLossConfig(**config))
    out.loss.sum().backward()
    return out, logprobs.grad


def _close(tensor, expected, atol=1e-12):
    return torch.allclose(tensor, torch.tensor(expected, dtype=tensor.dtype).reshape(tensor.shape),
                          rtol=0, atol=atol)


def test_ppo_clip_hand_worked():
    # eps 0.2; per token (r, A) -> max(-A r, -A clip(r, 0.8, 1.2)):
    # (1.5, +1): max(-1.5, -1.2) = -1.2 clipped   (1.5, -1): max(1.5, 1.2) = 1.5
    # (0.5, +1): max(-0.5, -0.8) = -0.5           (0.5, -1): max(0.5, 0.8) = 0.8 clipped
    # (1.1, +2): max(-2.2, -2.2) = -2.2
    inputs, lp = _case([1.5, 1.5, 0.5, 0.5, 1.1], [1.0, -1.0, 1.0, -1.0, 2.0])
    out, grad = _run("ppo_clip", inputs, lp)  # defaults: 0.2 both sides, no dual clip
    assert _close(out.loss, [-1.2, 1.5, -0.5, 0.8, -2.2])
    # d/dlogprob of -A r is -A r where unclipped, 0 where the clip won
    assert _close(grad, [0.0, 1.5, -0.5, 0.0, -2.2])
    assert abs(out.metrics["policy/clip_fraction"].item() - 2 / 5) <= 1e-12
    ppo_kl = -sum(math.log(r) for r in [1.5, 1.5, 0.5, 0.5, 1.1]) / 5
    assert abs(out.metrics["policy/ppo_kl"].item() - ppo_kl) <= 1e-12


def test_clip_higher_uses_both_bounds():
    # eps_low 0.1, eps_high 0.3 -> clip to [0.9, 1.3]:
    # (1.5, +1): -1.3 clipped by the high bound   (1.25, +1): -1.25 (ppo_clip at 0.2 would give -1.2)
    # (0.5, -1): max(0.5, 0.9) = 0.9 clipped by the low bound   (0.85, -1): max(0.85, 0.9) = 0.9
    # (0.85, +1): max(-0.85, -0.9) = -0.85
    inputs, lp = _case([1.5, 1.25, 0.5, 0.85, 0.85], [1.0, 1.0, -1.0, -1.0, 1.0])
    out, grad = _run("ppo_clip", inputs, lp, clip_eps_low=0.1, clip_eps_high=0.3)
    assert _close(out.loss, [-1.3, -1.25, 0.9, 0.9, -0.85])
    assert _close(grad, [0.0, -1.25, 0.0, 0.0, -0.85])
    assert abs(out.metrics["policy/clip_fraction"].item() - 3 / 5) <= 1e-12
    symmetric, _ = _run("ppo_clip", *_case([1.25], [1.0]), clip_eps_low=0.2, clip_eps_high=0.2)
    assert _close(symmetric.loss, [-1.2])


def test_dual_clip_hand_worked_and_bound():
    # c = 3, eps 0.2: (5, -1): ppo loss max(5, 1.2) = 5 > 3 -> 3 (dual clip)
    # (2, -1): 2 <= 3 -> 2   (5, +1): max(-5, -1.2) = -1.2 (A > 0 untouched)   (0.5, -2): max(1, 1.6) = 1.6
    inputs, lp = _case([5.0, 2.0, 5.0, 0.5], [-1.0, -1.0, 1.0, -2.0])
    out, grad = _run("ppo_clip", inputs, lp, dual_clip_c=3.0)
    assert _close(out.loss, [3.0, 2.0, -1.2, 1.6])
    assert _close(grad, [0.0, 2.0, 0.0, 0.0])
    assert abs(out.metrics["policy/dual_clip_fraction"].item() - 1 / 4) <= 1e-12
    generator = torch.Generator().manual_seed(0)
    ratios = torch.exp(3 * torch.randn(200, generator=generator, dtype=torch.float64)).tolist()
    advantages = (-torch.rand(200, generator=generator, dtype=torch.float64) * 2).tolist()
    out, _ = _run("ppo_clip", *_case(ratios, advantages), dual_clip_c=3.0)
    bound = -3.0 * torch.tensor([advantages], dtype=torch.float64)
    assert (out.loss <= bound + 1e-12).all()
    assert (out.loss > bound - 1e-12).any()  # the bound was active somewhere


def test_clip_higher_with_dual_clip_together():
    # DAPO-style: [1 - 0.2, 1 + 0.28] = [0.8, 1.28] and c = 3, in one loss:
    # (1.5, +1): max(-1.5, -1.28) = -1.28 (high bound)   (1.25, +1): -1.25 (inside the raised bound)
    # (0.5, -1): max(0.5, 0.8) = 0.8 (low bound)          (5, -1): max(5, 1.28) = 5 > 3 -> 3 (dual clip)
    # (2, -2): max(4, 2.56) = 4 <= 6 -> 4 (unclipped)
    inputs, lp = _case([1.5, 1.25, 0.5, 5.0, 2.0], [1.0, 1.0, -1.0, -1.0, -2.0])
    out, grad = _run("ppo_clip", inputs, lp, clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=3.0)
    assert _close(out.loss, [-1.28, -1.25, 0.8, 3.0, 4.0])
    assert _close(grad, [0.0, -1.25, 0.0, 0.0, 4.0])
    assert abs(out.metrics["policy/clip_fraction"].item() - 3 / 5) <= 1e-12
    assert abs(out.metrics["policy/dual_clip_fraction"].item() - 1 / 5) <= 1e-12
    without_dual, _ = _run("ppo_clip", *_case([5.0], [-1.0]), clip_eps_low=0.2, clip_eps_high=0.28)
    assert _close(without_dual.loss, [5.0]) and "policy/dual_clip_fraction" not in without_dual.metrics


def _gspo_inputs():
    # two sequences, lengths 3 and 2; NaN padding. log ratios: (0.1, -0.2, 0.4) mean 0.1;
    # (0.05, -0.01) mean 0.02.
    deltas = torch.tensor([[0.1, -0.2, 0.4], [0.05, -0.01, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, NAN]], dtype=torch.float64)
    logprobs = (old + deltas).requires_grad_(True)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, NAN]], dtype=torch.float64)
    return PolicyLossInputs(logprobs=logprobs, old_logprobs=old, advantages=advantages,
                            response_mask=mask), logprobs


def test_gspo_sequence_ratio_value_and_gradient():
    inputs, lp = _gspo_inputs()
    config = PolicyLossConfig(gspo_eps_low=0.2, gspo_eps_high=0.2)  # wide: nothing clipped
    out = POLICY_LOSSES.get("gspo")(inputs, config)
    s0, s1 = math.exp(0.1), math.exp(0.02)
    assert _close(out.loss, [[-s0, -s0, -s0], [2 * s1, 2 * s1, 0.0]])
    normaliser = compute_normaliser([inputs.response_mask])
    total = aggregate_loss(out.loss, inputs.response_mask, "seq_mean_token_mean", normaliser)
    total.backward()
    # GSPO objective (1/G) sum_i -A_i s_i, gradient -(1/G) A_i s_i / |y_i| on each token of sequence i
    assert abs(total.item() - (-s0 + 2 * s1) / 2) <= 1e-12
    assert _close(lp.grad, [[-s0 / 6] * 3, [2 * s1 / 4, 2 * s1 / 4, 0.0]])


def test_gspo_token_form_with_per_token_advantages():
    # GSPO-token: d loss_it / d logprob_ik = -A_it s_i [k == t] (each token's own advantage), which a
    # non-detached sequence ratio (gradient spread as s_i / |y_i| over the sequence) would not give.
    inputs, lp = _gspo_inputs()
    inputs.advantages = torch.tensor([[1.0, -0.5, 2.0], [0.5, -1.0, NAN]], dtype=torch.float64)
    out = POLICY_LOSSES.get("gspo")(inputs, PolicyLossConfig(gspo_eps_low=0.2, gspo_eps_high=0.2))
    out.loss.sum().backward()
    s0, s1 = math.exp(0.1), math.exp(0.02)
    assert _close(lp.grad, [[-s0, 0.5 * s0, -2.0 * s0], [-0.5 * s1, s1, 0.0]])


def test_gspo_clips_the_sequence_ratio():
    inputs, lp = _gspo_inputs()
    out = POLICY_LOSSES.get("gspo")(inputs, PolicyLossConfig(gspo_eps_low=3e-4, gspo_eps_high=4e-4))
    # s0 = e^0.1 > 1.0004 with A > 0: clipped to -1.0004; s1 = e^0.02 > 1.0004 with A < 0: unclipped
    s1 = math.exp(0.02)
    assert _close(out.loss, [[-1.0004] * 3, [2 * s1, 2 * s1, 0.0]])
    out.loss.sum().backward()
    assert _close(lp.grad, [[0.0] * 3, [2 * s1, 2 * s1, 0.0]])
    assert abs(out.metrics["policy/clip_fraction"].item() - 3 / 5) <= 1e-12


def test_cispo_stop_gradient_weight():
    # ratios (1.5, 0.5, 1.1), A (1, -2, 0.5), eps_high 0.28, no floor: weights (1.28, 0.5, 1.1)
    inputs, lp = _case([1.5, 0.5, 1.1], [1.0, -2.0, 0.5], old=-1.0)
    out, grad = _run("cispo", inputs, lp, cispo_eps_high=0.28)
    logprobs = [-1.0 + math.log(r) for r in (1.5, 0.5, 1.1)]
    assert _close(out.loss, [-1.28 * 1.0 * logprobs[0], 0.5 * 2.0 * logprobs[1], -1.1 * 0.5 * logprobs[2]])
    assert _close(grad, [-1.28, 1.0, -0.55])  # -sg(w) * A: every token keeps a gradient
    assert abs(out.metrics["policy/clip_fraction"].item() - 1 / 3) <= 1e-12
    floored, grad = _run("cispo", *_case([1.5, 0.5, 1.1], [1.0, -2.0, 0.5]), cispo_eps_high=0.28,
                         cispo_eps_low=0.2)
    assert _close(grad, [-1.28, 1.6, -0.55])  # the 0.5 weight is floored at 0.8


def test_vanilla_pg():
    inputs, lp = _case([1.5, 0.5], [1.0, -2.0], old=-1.0)
    out, grad = _run("vanilla_pg", inputs, lp)
    assert _close(out.loss, [(-1.0 + math.log(1.5)) * -1.0, (-1.0 + math.log(0.5)) * 2.0])
    assert _close(grad, [-1.0, 2.0])
    assert out.metrics["policy/clip_fraction"].item() == 0.0


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_rollout_is_weights_scale_the_loss(name):
    inputs, _ = _case([1.5, 0.7, 1.05], [1.0, -1.0, 0.5])
    weights = torch.tensor([[0.5, 2.0, 1.0]], dtype=torch.float64)
    plain = POLICY_LOSSES.get(name)(inputs, PolicyLossConfig()).loss
    inputs.rollout_is_weights = weights
    weighted = POLICY_LOSSES.get(name)(inputs, PolicyLossConfig()).loss
    assert torch.allclose(weighted, plain * weights, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_padding_never_leaks(name):
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    base_lp = torch.tensor([[-1.0, -0.4, 0.0], [-2.0, 0.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-1.1, -0.5, 0.0], [-1.9, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[0.7, -0.3, 0.0], [1.2, 0.0, 0.0]], dtype=torch.float64)
    results = []
    for garbage in (0.0, NAN, math.inf):
        def fill(x):
            return torch.where(mask, x, torch.full_like(x, garbage))
        lp = fill(base_lp).requires_grad_(True)
        inputs = PolicyLossInputs(logprobs=lp, old_logprobs=fill(old), advantages=fill(adv),
                                  response_mask=mask, rollout_is_weights=fill(torch.ones_like(adv)))
        out = POLICY_LOSSES.get(name)(inputs, PolicyLossConfig())
        out.loss.sum().backward()
        assert torch.isfinite(lp.grad).all() and (lp.grad[~mask] == 0).all()
        assert all(torch.isfinite(v) for v in out.metrics.values())
        results.append((out.loss.detach(), lp.grad, {k: v.item() for k, v in out.metrics.items()}))
    for loss, grad, metrics in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])
        assert metrics == results[0][2]


def test_value_loss_hand_worked():
    # clip 0.2, (V, old, R):
    # (1.0, 0.5, 2.0): V' = 0.7; max(1, 1.69) -> 0.845, clipped branch, gradient 0
    # (0.6, 0.5, 2.0): V' = 0.6; both 1.96 -> 0.98, gradient V - R = -1.4
    # (1.0, 0.5, 0.0): V' = 0.7; max(1, 0.49) -> 0.5, gradient V - R = 1.0
    values = torch.tensor([[1.0, 0.6, 1.0, NAN]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, NAN]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 2.0, 0.0, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    out = value_loss(values, old, returns, mask, 0.2)
    out.loss.sum().backward()
    assert _close(out.loss, [0.845, 0.98, 0.5, 0.0])
    assert _close(values.grad, [0.0, -1.4, 1.0, 0.0])
    assert abs(out.metrics["value/clip_fraction"].item() - 1 / 3) <= 1e-12
    unclipped = value_loss(values, old, returns, mask, None)
    assert _close(unclipped.loss, [0.5, 0.98, 0.5, 0.0])
    with pytest.raises(ValueError, match="clip_range must be > 0"):
        value_loss(values, old, returns, mask, 0.0)


def test_entropy_bonus():
    entropy = torch.tensor([[2.0, 0.5, NAN]])
    bonus = entropy_bonus(entropy, torch.tensor([[1, 1, 0]]), 0.01)
    assert torch.allclose(bonus, torch.tensor([[-0.02, -0.005, 0.0]]), rtol=0, atol=1e-9)


def test_bad_config_and_inputs_are_named():
    with pytest.raises(ValueError, match="PolicyLossConfig.dual_clip_c must be > 1 or null"):
        PolicyLossConfig(dual_clip_c=1.0)
    with pytest.raises(ValueError, match="PolicyLossConfig.clip_eps_high must be >= 0"):
        PolicyLossConfig(clip_eps_high=-0.1)
    with pytest.raises(ValueError, match="PolicyLossConfig.clip_eps_low must be < 1"):
        PolicyLossConfig(clip_eps_low=1.0)
    with pytest.raises(ValueError, match=r"PolicyLossInputs: advantages has shape \(2, 2\)"):
        PolicyLossInputs(logprobs=torch.zeros(2, 3), old_logprobs=torch.zeros(2, 3),
                         advantages=torch.zeros(2, 2), response_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="response_mask must hold only 0 and 1"):
        PolicyLossInputs(logprobs=torch.zeros(1, 2), old_logprobs=torch.zeros(1, 2),
                         advantages=torch.zeros(1, 2), response_mask=torch.tensor([[1, 2]]))
