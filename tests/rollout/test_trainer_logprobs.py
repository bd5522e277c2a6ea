"""Trainer-side teacher-forced log-probs (the training forward: packed micro-batches, fused op) vs a naive
reference: log_softmax of the full logits (TP-gathered, padded vocab cut off), in fp64, at temperature 1
and 0.7, over several micro-batches, at TP=1 and TP=2 (TP=2 pads the tiny vocab 384 -> 512, so the
padded-row masking is exercised)."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_training_forward_logprobs_match_full_logits(rollout_run, layout):
    for rank in rollout_run(layout):
        r = rank["naive_logprobs"]
        assert r["shape"] == [4, 19]
        assert r["t1.0"] < 1e-5 and r["t0.7"] < 1e-5, r
