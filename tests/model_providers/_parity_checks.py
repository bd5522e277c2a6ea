"""Assertions shared by the per-architecture test files on the parity worker's results."""
from __future__ import annotations

LOGIT_TOL = 1e-4  # fp32, Megatron vs HF transformers (measured ~1e-6)


def arch_results(ranks: list[dict], arch: str) -> tuple[dict, dict]:
    """(rank 0's results, the last pipeline stage's results) for ``arch``."""
    last = [r for r in ranks if r["last_stage"]][0]
    return ranks[0][arch], last[arch]


def assert_parity(ranks: list[dict], arch: str, tp: int) -> None:
    first, last = arch_results(ranks, arch)
    padded = {1: 384, 2: 512}[tp]  # vocab 384 padded to a multiple of 128 * tp
    assert first["padded_vocab"] == padded
    assert last["logits_shape"] == [2, 19, padded]
    assert last["logit_max_diff"] <= LOGIT_TOL, last["logit_max_diff"]
    assert last["inv_freq_max_diff"] <= 1e-9
    assert last["padded_logits_max_abs"] == 0.0  # zero padded rows give exactly-zero logits
    for rank in ranks:
        assert rank[arch]["round_trip"] == {"missing": [], "extra": [], "duplicates": 0, "not_equal": []}
        assert rank[arch]["export"]["reload_equal"] is True
    export = first["export"]
    assert export["weights_equal"] is True
    assert export["generations_equal"] is True
    assert "model.safetensors.index.json" in export["files"] and "tokenizer.json" in export["files"]
    assert len(export["generated"][0]) == 12
