"""The teacher's top-k op (megarlhf.ops.topk_logprobs) against the full log-softmax, at TP 1 in-process (TP 2
runs in tests/ops/test_fused_logprob.py's torchrun worker), in fp32 and bf16, with its input errors."""
from __future__ import annotations

import pytest
import torch

from _logprob_reference import CASES, make_case, naive_topk
from megarlhf.ops import LogprobOptions, topk_logprobs


def _max(a, b) -> float:
    """max |a - b|; an entry -inf in both (nothing outside the top-k) agrees, -inf in one only is inf."""
    if not a.numel():
        return 0.0
    both = torch.isinf(a) & torch.isinf(b) & (a == b)
    return float(torch.where(both, 0.0, (a - b).abs()).max())


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("k", [1, 5, 202])
def test_matches_full_log_softmax(name, k):
    hidden, weight, targets, mask, _, _, chunk, temperature = make_case(name)
    k = min(k, weight.shape[0])
    got = topk_logprobs(hidden, weight, targets, mask, k, LogprobOptions(temperature=temperature, chunk_size=chunk))
    want = naive_topk(hidden, weight, targets, mask, temperature, k)
    assert got[1].shape == got[2].shape == (hidden.shape[0], k) and got[2].dtype == torch.long
    assert _max(got[0], want[0]) <= 1e-5 and _max(got[1], want[1]) <= 1e-5
    assert torch.equal(got[2], want[2])
    if k == weight.shape[0]:  # the whole vocabulary: its probabilities sum to 1, nothing is left
        assert torch.allclose(got[1].exp().sum(1)[mask if mask is not None else slice(None)], torch.tensor(1.0),
                              atol=1e-5)
        assert torch.isinf(got[3][mask if mask is not None else slice(None)]).all()
    assert _max(got[3], want[3]) <= 1e-5


@pytest.mark.parametrize("k", [1, 4, 20])
def test_the_rest_of_a_confident_distribution_keeps_its_precision(k):
    """Logits of ~+-30 (a confident model): the top-1 log-prob rounds to 0 in fp32, so 1 - sum(top-k) would say
    nothing is left; the op sums the small terms themselves and gets the rest (1e-6 .. 1e-20) to its digits."""
    hidden, weight, targets, mask, _, _, chunk, _ = make_case("temperature")
    hidden = hidden * 25
    got = topk_logprobs(hidden, weight, targets, mask, k, LogprobOptions(chunk_size=chunk))
    want = naive_topk(hidden, weight, targets, mask, 1.0, k)
    assert (want[3] < -13).any()  # some rows have less than 2e-6 outside their top-k
    assert (got[1][:, 0] == 0).any()  # where fp32 rounds the top-1 log-prob to 0
    assert _max(got[3], want[3]) <= 1e-3  # fp32 logits of ~30: relative precision ~1e-6, i.e. ~1e-4 in log


def test_bf16_picks_the_top_of_bf16_logits():
    """In bf16 the op ranks the bf16 products of bf16 inputs (as a bf16 output layer does): its values are the
    top-k of those logits' log-softmax (ties may come in any order), and each id's log-prob is its value."""
    hidden, weight, targets, mask, _, _, chunk, temperature = make_case("temperature", torch.bfloat16)
    got = topk_logprobs(hidden, weight, targets, mask, 4, LogprobOptions(temperature=temperature, chunk_size=chunk))
    assert got[1].dtype == torch.float32
    logp = torch.log_softmax((hidden / temperature @ weight.t()).float(), dim=-1)
    assert _max(got[1], torch.topk(logp, 4, dim=1).values) <= 1e-5
    assert _max(logp.gather(1, got[2]), got[1]) <= 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("below", [0, 2])
def test_padded_vocabulary_rows_never_enter_the_top_k(temperature, below):
    """Megatron's padded rows (logit -1e30, -2e30 at T 0.5) are neither in the top-k nor in its rest, up to k =
    the real vocabulary (the run refuses a larger top_k)."""
    hidden, weight, targets, mask, _, _, chunk, _ = make_case("masked")
    vocab = weight.shape[0]
    padded = torch.cat([weight, 10 * torch.ones(6, weight.shape[1])])  # large logits, but padding
    bias = torch.cat([torch.zeros(vocab), torch.full((6,), -1.0e30)])[:, None]
    h1 = torch.cat([hidden, torch.ones(hidden.shape[0], 1)], dim=1)
    options = LogprobOptions(chunk_size=chunk, temperature=temperature)
    got = topk_logprobs(h1, torch.cat([padded, bias], dim=1), targets, mask, vocab - below, options)
    want = naive_topk(hidden, weight, targets, mask, temperature, vocab - below)
    assert int(got[2].max()) < vocab and torch.equal(got[2], want[2]) and _max(got[1], want[1]) <= 1e-5
    assert _max(got[3], want[3]) <= 1e-5


def test_bad_inputs():
    hidden, weight, targets, mask, *_ = make_case("masked")
    with pytest.raises(ValueError, match=r"k must be an int in \[1, 202\]"):
        topk_logprobs(hidden, weight, targets, mask, 203)
    with pytest.raises(ValueError, match=r"k must be an int"):
        topk_logprobs(hidden, weight, targets, mask, 0)
    with pytest.raises(ValueError, match=r"targets must be \[N\]"):
        topk_logprobs(hidden, weight, targets[:, None], mask, 3)
    with pytest.raises(ValueError, match="hidden size mismatch"):
        topk_logprobs(hidden, weight[:, :-1], targets, mask, 3)
