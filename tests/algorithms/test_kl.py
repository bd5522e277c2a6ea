"""KL estimators against hand-worked values, clamping, hand-derived gradients, a Monte-Carlo check of
unbiasedness on a known categorical pair, and the reward-penalty / loss-term helpers."""
from __future__ import annotations

import math

import pytest
import torch

from megarlhf.algorithms import KL_ESTIMATORS, kl_loss, kl_reward_penalty
from megarlhf.config.algorithm import KLConfig

NAN = float("nan")


def test_hand_worked_values():
    # log pi = -1.0, log pi_ref = -1.5: d = 0.5
    lp, ref = torch.tensor([[-1.0]], dtype=torch.float64), torch.tensor([[-1.5]], dtype=torch.float64)
    config = KLConfig()
    assert KL_ESTIMATORS.get("k1")(lp, ref, config).item() == 0.5
    assert KL_ESTIMATORS.get("k2")(lp, ref, config).item() == 0.125
    assert abs(KL_ESTIMATORS.get("k3")(lp, ref, config).item() - (math.exp(-0.5) - 1 + 0.5)) <= 1e-15


def test_clamping_and_finite_gradients():
    lp = torch.tensor([[-40.0, -1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0, -40.0, -1.2]], dtype=torch.float64)  # d = -39, 39, 0.2
    config = KLConfig(clamp_min=-10.0, clamp_max=10.0, log_ratio_limit=20.0)
    for name, expected in (("k1", [-10.0, 10.0, 0.2]), ("k2", [10.0, 10.0, 0.02]),
                           ("k3", [10.0, 10.0, math.exp(-0.2) - 1 + 0.2])):
        lp.grad = None
        kl = KL_ESTIMATORS.get(name)(lp, ref, config)
        kl.sum().backward()
        assert torch.allclose(kl, torch.tensor([expected], dtype=torch.float64), rtol=0, atol=1e-12), name
        assert torch.isfinite(lp.grad).all() and (lp.grad[0, :2] == 0).all(), name
    unclamped = KLConfig(clamp_min=None, clamp_max=None, log_ratio_limit=20.0)
    value = KL_ESTIMATORS.get("k3")(lp, ref, unclamped)[0, 0].item()
    assert abs(value - (math.exp(20.0) - 1 - 20.0)) <= 1e-6  # d limited to -20 before exp


def test_k1_and_k3_are_unbiased_k2_is_not():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    exact = float((p * (p / q).log()).sum())
    samples = torch.multinomial(p, 400_000, replacement=True, generator=torch.Generator().manual_seed(0))
    lp, ref = p.log()[samples][None, :], q.log()[samples][None, :]
    config = KLConfig(clamp_min=None, clamp_max=None)
    for name in ("k1", "k3"):
        estimate = KL_ESTIMATORS.get(name)(lp, ref, config)
        stderr = float(estimate.std()) / math.sqrt(samples.numel())
        assert abs(float(estimate.mean()) - exact) <= 5 * stderr, name
    k2 = KL_ESTIMATORS.get("k2")(lp, ref, config)
    assert abs(float(k2.mean()) - exact) > 10 * float(k2.std()) / math.sqrt(samples.numel())


def test_reward_penalty_and_loss_term():
    mask = torch.tensor([[1, 1, 0]])
    lp = torch.tensor([[-1.0, -0.5, NAN]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -0.25, NAN]], dtype=torch.float64)
    config = KLConfig(estimator="k3", coef=0.1)
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(0.25) - 1 - 0.25]
    rewards = kl_reward_penalty(torch.tensor([[0.3, 0.0, NAN]], dtype=torch.float64), lp, ref, mask, config)
    expected = torch.tensor([[0.3 - 0.1 * k3[0], -0.1 * k3[1], 0.0]], dtype=torch.float64)
    assert torch.allclose(rewards, expected, rtol=0, atol=1e-12) and not rewards.requires_grad
    no_rewards = kl_reward_penalty(None, lp, ref, mask, config)
    assert torch.allclose(no_rewards, expected - torch.tensor([[0.3, 0.0, 0.0]], dtype=torch.float64),
                          rtol=0, atol=1e-12)
    loss = kl_loss(lp, ref, mask, config)
    loss.sum().backward()
    assert torch.allclose(loss, torch.tensor([[0.1 * k3[0], 0.1 * k3[1], 0.0]], dtype=torch.float64),
                          rtol=0, atol=1e-12)
    # d k3 / d logprob = 1 - exp(ref - logprob)
    grad = [0.1 * (1 - math.exp(-0.5)), 0.1 * (1 - math.exp(0.25)), 0.0]
    assert torch.allclose(lp.grad, torch.tensor([grad], dtype=torch.float64), rtol=0, atol=1e-12)


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="KLConfig.coef must be >= 0"):
        KLConfig(coef=-1.0)
    with pytest.raises(ValueError, match="KLConfig.clamp_min"):
        KLConfig(clamp_min=1.0, clamp_max=0.0)
    with pytest.raises(ValueError, match=r"kl_loss: ref_logprobs has shape \(1, 2\)"):
        kl_loss(torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 3), KLConfig())
