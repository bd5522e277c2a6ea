"""Rollout/trainer mismatch: truncated IS weights (token and sequence level), gap masking and the
metrics, against hand-worked values; padding is never read and weights carry no gradient."""
from __future__ import annotations

import math

import pytest
import torch

from megarlhf.config.algorithm import MismatchConfig
from megarlhf.algorithms import logprob_gap_mask, rollout_correction, truncated_is_weights

NAN = float("nan")
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
# deltas trainer - rollout: row 0 (0.5, -0.2, 1.5), row 1 (-0.1, 0.3)
ROLLOUT = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.0, NAN]], dtype=torch.float64)
TRAINER = torch.tensor([[-0.5, -2.2, -1.5], [-0.6, -0.7, NAN]], dtype=torch.float64)
DELTAS = [[0.5, -0.2, 1.5], [-0.1, 0.3]]


def test_token_level_weights():
    trainer = TRAINER.clone().requires_grad_(True)
    weights = truncated_is_weights(trainer, ROLLOUT, MASK, "token", cap=2.0)
    expected = [[math.exp(0.5), math.exp(-0.2), 2.0], [math.exp(-0.1), math.exp(0.3), 0.0]]
    assert torch.allclose(weights, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    assert not weights.requires_grad


def test_sequence_level_weights():
    weights = truncated_is_weights(TRAINER, ROLLOUT, MASK, "sequence", cap=2.0)
    # row 0: exp(0.5 - 0.2 + 1.5) = exp(1.8) > 2 -> 2; row 1: exp(0.2)
    expected = [[2.0, 2.0, 2.0], [math.exp(0.2), math.exp(0.2), 0.0]]
    assert torch.allclose(weights, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    huge = truncated_is_weights(TRAINER + 1e4 * MASK, ROLLOUT, MASK, "sequence", cap=3.0)
    assert torch.allclose(huge[MASK], torch.full((5,), 3.0, dtype=torch.float64), rtol=0, atol=1e-12)


def test_gap_mask_and_metrics():
    config = MismatchConfig(tis_level="token", tis_cap=2.0, mask_threshold=0.4)
    out = rollout_correction(TRAINER, ROLLOUT, MASK, config)
    assert torch.equal(out.response_mask, torch.tensor([[0, 1, 0], [1, 1, 0]], dtype=torch.bool))
    flat = [abs(d) for row in DELTAS for d in row]
    metrics = {k: v.item() for k, v in out.metrics.items()}
    assert abs(metrics["mismatch/logprob_abs_diff_max"] - 1.5) <= 1e-12
    assert abs(metrics["mismatch/logprob_abs_diff_mean"] - sum(flat) / 5) <= 1e-12
    assert abs(metrics["mismatch/exp_abs_diff_mean"] - sum(math.exp(d) for d in flat) / 5) <= 1e-12
    assert abs(metrics["mismatch/masked_fraction"] - 2 / 5) <= 1e-12
    weights = [math.exp(0.5), math.exp(-0.2), 2.0, math.exp(-0.1), math.exp(0.3)]
    assert abs(metrics["mismatch/is_weight_mean"] - sum(weights) / 5) <= 1e-12
    assert torch.equal(logprob_gap_mask(TRAINER, ROLLOUT, MASK, 0.4), out.response_mask)


def test_no_correction_keeps_mask_and_gives_no_weights():
    out = rollout_correction(TRAINER, ROLLOUT, MASK, MismatchConfig(tis_level=None, mask_threshold=None))
    assert out.is_weights is None and torch.equal(out.response_mask, MASK)
    assert out.metrics["mismatch/masked_fraction"].item() == 0.0


def test_padding_is_never_read():
    config = MismatchConfig(tis_level="sequence", mask_threshold=0.4)
    clean = rollout_correction(TRAINER.nan_to_num(0.0), ROLLOUT.nan_to_num(0.0), MASK, config)
    dirty = rollout_correction(TRAINER.nan_to_num(1e30), ROLLOUT.nan_to_num(-1e30), MASK, config)
    assert torch.equal(clean.is_weights, dirty.is_weights)
    assert torch.equal(clean.response_mask, dirty.response_mask)
    assert {k: v.item() for k, v in clean.metrics.items()} == {k: v.item() for k, v in dirty.metrics.items()}


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="MismatchConfig.tis_level must be one of"):
        MismatchConfig(tis_level="batch")
    with pytest.raises(ValueError, match="MismatchConfig.tis_cap must be > 0"):
        MismatchConfig(tis_cap=0.0)
    with pytest.raises(ValueError, match="MismatchConfig.mask_threshold"):
        MismatchConfig(mask_threshold=-1.0)
