"""Rollout correction for samples whose tokens come from two policy versions (a generation that spanned a
weight update, or a share regenerated after an engine restart), worked by hand.

Each token's behaviour log-prob is the one recorded by the version that sampled it, so delta_t = trainer - that
log-prob per token. Row 0: tokens 0-1 sampled by version 0 (behaviour -1.2, -1.9), tokens 2-3 by version 1 (-0.5,
-1.4), trainer -1.0, -2.0, -0.5, -1.0: deltas 0.2, -0.1, 0.0, 0.4. Row 1: one version, three tokens and a pad:
deltas 0.0, -0.1, -0.1.
"""
import math

import pytest
import torch

from megarlhf.algorithms.mismatch import rollout_correction
from megarlhf.config.algorithm import MismatchConfig

TRAINER = torch.tensor([[-1.0, -2.0, -0.5, -1.0], [-0.3, -0.7, -1.1, 0.0]], dtype=torch.float64)
BEHAVIOUR = torch.tensor([[-1.2, -1.9, -0.5, -1.4], [-0.3, -0.6, -1.0, 5.0]], dtype=torch.float64)  # pad: junk
MASK = torch.tensor([[True, True, True, True], [True, True, True, False]])


def test_token_level_weights_use_each_tokens_own_version():
    out = rollout_correction(TRAINER, BEHAVIOUR, MASK, MismatchConfig(tis_level="token", tis_cap=1.3))
    expected = [[math.exp(0.2), math.exp(-0.1), 1.0, 1.3], [1.0, math.exp(-0.1), math.exp(-0.1), 0.0]]  # 0.4 capped
    assert torch.allclose(out.is_weights, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    assert out.metrics["mismatch/is_weight_mean"].item() == pytest.approx(sum(map(sum, expected)) / 7, abs=1e-12)
    assert out.metrics["mismatch/logprob_abs_diff_max"].item() == pytest.approx(0.4, abs=1e-12)


def test_sequence_level_weights_multiply_both_versions_ratios():
    out = rollout_correction(TRAINER, BEHAVIOUR, MASK, MismatchConfig(tis_level="sequence", tis_cap=1.5))
    # row 0: exp(0.2 - 0.1 + 0.0 + 0.4) = exp(0.5) = 1.6487 > 1.5, capped; row 1: exp(-0.2) = 0.8187
    expected = [[1.5] * 4, [math.exp(-0.2)] * 3 + [0.0]]
    assert torch.allclose(out.is_weights, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_gap_masking_drops_only_the_tokens_past_the_threshold_whatever_their_version():
    out = rollout_correction(TRAINER, BEHAVIOUR, MASK, MismatchConfig(tis_level=None, mask_threshold=0.3))
    assert out.response_mask.tolist() == [[True, True, True, False], [True, True, True, False]]
    assert out.metrics["mismatch/masked_fraction"].item() == pytest.approx(1 / 7, abs=1e-12)
    assert out.is_weights is None
