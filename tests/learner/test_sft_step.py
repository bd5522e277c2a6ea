"""One packed SFT step: the loss is HF's cross-entropy over the response tokens (token mean), and the
gradient norm matches HF's (single-rank worker, fp32)."""
from __future__ import annotations


def test_sft_loss_and_grad_norm_match_hf(single_run):
    r = single_run["sft"]
    assert r["tokens"][0] == r["tokens"][1]
    assert abs(r["loss"][0] - r["loss"][1]) <= 1e-5 * abs(r["loss"][1]), r
    assert abs(r["grad_norm"][0] - r["grad_norm"][1]) <= 1e-5 * abs(r["grad_norm"][1]), r
