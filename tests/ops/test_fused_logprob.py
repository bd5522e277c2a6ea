"""The torch fused log-prob/entropy op against the naive full-logits reference (TP=1 in-process,
TP=2 under torchrun), in fp32 and bf16, plus its memory contract and input errors."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _logprob_reference import CASES, make_case, naive_logprob_entropy, outputs_and_grads
from megarlhf.ops import LogprobOptions, fused_logprob_entropy, logprob_entropy
from megarlhf.testing.launch import read_rank_results, run_torchrun

HERE = Path(__file__).parent


def _max(a, b) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("compute_entropy", [True, False])
@pytest.mark.parametrize("targets_per_row", [None, 3], ids=["one_target", "three_targets"])
def test_matches_naive_fp32_tp1(name, compute_entropy, targets_per_row):
    hidden, weight, targets, mask, ra, rb, chunk, temperature = make_case(name, targets_per_row=targets_per_row)
    rb = rb if compute_entropy else torch.zeros_like(rb)
    lp, ent, gh, gw = outputs_and_grads(
        lambda h, w: fused_logprob_entropy(h, w, targets, mask, LogprobOptions(
            temperature=temperature, chunk_size=chunk, compute_entropy=compute_entropy)),
        hidden, weight, ra, rb)
    ref = outputs_and_grads(lambda h, w: naive_logprob_entropy(h, w, targets, mask, temperature),
                            hidden, weight, ra, rb)
    assert _max(lp, ref[0]) <= 1e-5
    if compute_entropy:
        assert _max(ent, ref[1]) <= 1e-5
    else:
        assert ent is None
    assert _max(gh, ref[2]) <= 1e-4 and _max(gw, ref[3]) <= 1e-4
    assert lp.shape == targets.shape
    if mask is not None:
        assert (lp[~mask] == 0).all() and (gh[~mask] == 0).all()
    if mask is not None and not mask.any():
        assert not gh.any() and not gw.any()


@pytest.mark.parametrize("name", ["masked", "temperature", "all_masked"])
@pytest.mark.parametrize("scale", [1.0, 10.0], ids=["logits_1", "confident_logits_15"])
def test_rest_column_matches_naive(name, scale):
    """With rest_from, one more column: the log-probability outside targets[:, rest_from:], with its gradient; for
    confident logits too, where 1 minus the targets' fp32 probabilities would lose it (fp32 tolerances scale with
    the logits)."""
    hidden, weight, targets, mask, ra, rb, chunk, temperature = make_case(name, targets_per_row=4)
    hidden = hidden * scale
    ra = torch.cat([ra, torch.randn(len(ra), 1, generator=torch.Generator().manual_seed(3))], dim=1)
    options = LogprobOptions(temperature=temperature, chunk_size=chunk, rest_from=1)
    lp, ent, gh, gw = outputs_and_grads(lambda h, w: fused_logprob_entropy(h, w, targets, mask, options),
                                        hidden, weight, ra, rb)
    ref = outputs_and_grads(lambda h, w: naive_logprob_entropy(h, w, targets, mask, temperature, 1),
                            hidden, weight, ra, rb)
    assert lp.shape == (hidden.shape[0], 5)
    assert _max(lp, ref[0]) <= 1e-5 * scale and _max(ent, ref[1]) <= 1e-5 * scale
    for got, want in ((gh, ref[2]), (gw, ref[3])):
        assert _max(got, want) <= 2e-5 * max(1.0, float(want.abs().max()))
    with pytest.raises(ValueError, match="rest_from=4 needs"):
        fused_logprob_entropy(hidden, weight, targets, mask, LogprobOptions(rest_from=4))


def test_rest_column_far_below_and_empty():
    """A rest 95 nats below the targets (below fp32's smallest normal as a probability) keeps its value and gradient
    (a log-domain sum); targets covering the vocabulary leave nothing: the column is -inf and gets no gradient."""
    gen = torch.Generator().manual_seed(4)
    n, h, v = 5, 8, 12
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen)
    weight[:3] += 14.0 * hidden.mean(0) / hidden.mean(0).norm() ** 2  # tokens 0-2 far above the rest
    hidden = hidden.mean(0, keepdim=True).expand(n, h).clone() * 8 + 0.01 * hidden
    targets = torch.tensor([[5, 0, 1, 2]] * n)
    ra = torch.cat([torch.zeros(n, 4), torch.ones(n, 1)], dim=1)  # the rest's gradient alone
    options = LogprobOptions(chunk_size=5, rest_from=1, compute_entropy=False)
    got = outputs_and_grads(lambda x, w: fused_logprob_entropy(x, w, targets, None, options), hidden, weight, ra,
                            torch.zeros(n))
    ref = outputs_and_grads(lambda x, w: (naive_logprob_entropy(x, w, targets, None, 1.0, 1)[0], None),
                            hidden.double(), weight.double(), ra.double(), torch.zeros(n))
    assert (ref[0][:, -1] < -88).all()  # exp(rest) underflows fp32
    assert _max(got[0][:, -1].double(), ref[0][:, -1]) <= 1e-3 * float(ref[0][:, -1].abs().max())
    assert _max(got[2].double(), ref[2]) <= 1e-4 * float(ref[2].abs().max())
    everything = torch.arange(v).expand(n, v)
    lp, _ = fused_logprob_entropy(hidden.requires_grad_(), weight, torch.cat([targets[:, :1], everything], 1), None,
                                  options)
    lp[:, -1].clamp(min=-700).sum().backward()
    assert torch.isinf(lp[:, -1]).all() and not hidden.grad.any()


def test_entropy_only_gradient():
    """A loss on the entropy alone still backprops (log-prob output gets no gradient)."""
    hidden, weight, targets, mask, ra, rb, chunk, temperature = make_case("temperature")
    zero = torch.zeros_like(ra)
    options = LogprobOptions(chunk_size=chunk, temperature=temperature)
    got = outputs_and_grads(lambda h, w: fused_logprob_entropy(h, w, targets, mask, options),
                            hidden, weight, zero, rb)
    ref = outputs_and_grads(lambda h, w: naive_logprob_entropy(h, w, targets, mask, temperature),
                            hidden, weight, zero, rb)
    assert _max(got[2], ref[2]) <= 1e-4 and _max(got[3], ref[3]) <= 1e-4


def check_worker_results(results: list[dict]) -> None:
    """fp32 tolerances of the TP=1 and TP=2 runs of _worker_logprob (shared with the Triton test)."""
    for rank_result in results:
        assert any(key.endswith("/tp2") for key in rank_result)
        for name, r in rank_result.items():
            if name.startswith("topk/"):  # the top-k op's: tests/ops/test_topk_logprob.py
                continue
            assert r["logprob"] <= 1e-5 and r["entropy"] <= 1e-5, (name, r)
            assert r["grad_hidden"] <= 1e-4 and r["grad_weight"] <= 1e-4, (name, r)
            if name.endswith("/tp2"):
                assert r["grad_hidden_same_on_ranks"] and r["masked_outputs_zero"], (name, r)
                assert r["masked_grads_zero"], (name, r)


def test_tp2_matches_unsharded_naive(tmp_path):
    run_torchrun(HERE / "_worker_logprob.py", 2, [str(tmp_path), "torch"], timeout_s=180)
    results = read_rank_results(tmp_path, 2)
    check_worker_results(results)
    topk = [(name, r) for rank_result in results for name, r in rank_result.items() if name.startswith("topk/")]
    assert len(topk) == 2 * 3 * len(CASES)  # the teacher's top-k op at TP 2 (tests/ops/test_topk_logprob.py)
    for name, r in topk:
        assert r["target"] <= 1e-5 and r["values"] <= 1e-5 and r["ids_equal"] and r["rest"] <= 1e-5, (name, r)


@pytest.mark.parametrize("name", ["masked", "temperature"])
def test_bf16_against_fp32_reference(name):
    """bf16 inputs vs the fp32 naive reference on the same (bf16-representable) values.

    The op's logits come out of a bf16 matmul (as a bf16 Megatron output layer's do), so each logit
    is rounded to bf16: up to half an ulp, 2^-9 * |logit|. A log-prob (target logit minus
    logsumexp) and an entropy can each be off by about one ulp of the largest logit, hence the
    stated tolerance 2^-8 * max|logit| (~0.03 here) on outputs; gradients are bf16 themselves:
    2^-6 relative (Frobenius). Measured: outputs 5e-3..1.7e-2, grads 4e-3..7e-3, the same as the
    naive op computed from bf16 logits. An fp32-accumulation bug would give O(1) errors.
    """
    hidden, weight, targets, mask, ra, rb, chunk, temperature = make_case(name, torch.bfloat16)
    lp, ent, gh, gw = outputs_and_grads(
        lambda h, w: fused_logprob_entropy(h, w, targets, mask, LogprobOptions(chunk_size=chunk, temperature=temperature)),
        hidden, weight, ra, rb)
    assert lp.dtype == torch.float32 and gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    ref = outputs_and_grads(lambda h, w: naive_logprob_entropy(h, w, targets, mask, temperature),
                            hidden.float(), weight.float(), ra, rb)
    tol = 2 ** -8 * float((hidden.float() @ weight.float().t()).abs().max()) / temperature
    assert _max(lp, ref[0]) <= tol and _max(ent, ref[1]) <= tol
    for got, want in ((gh, ref[2]), (gw, ref[3])):
        assert float((got.float() - want).norm() / want.norm()) <= 2 ** -6


def _saved_bytes(fn) -> list[int]:
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_memory_never_tokens_by_vocab():
    """Saved-for-backward bytes and every intermediate stay far below one tokens x vocab tensor."""
    n, h, v, chunk = 64, 16, 4096, 256
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, h, generator=gen, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=gen)
    ra = torch.randn(n, generator=gen)

    def fused():
        lp, ent = fused_logprob_entropy(hidden, weight, targets, options=LogprobOptions(chunk_size=chunk))
        return (ra * lp + ent).sum()

    def naive():
        lp, ent = naive_logprob_entropy(hidden, weight, targets, None, 1.0)
        return (ra * lp + ent).sum()

    tokens_by_vocab = n * v * 4
    saved = _saved_bytes(fused)
    # hidden rows + weight (both inputs) + four fp32/int64 per-token vectors
    assert sum(saved) <= (n * h + v * h) * 4 + 4 * n * 8 < tokens_by_vocab
    assert max(_saved_bytes(naive)) >= tokens_by_vocab   # the probe does see such tensors
    for fn, expect_small in ((fused, True), (naive, False)):
        with _LargestTensor() as probe:
            fn().backward()
        # the largest fused tensors are one [tokens, chunk] block and grad_weight [vocab, hidden]
        assert (probe.largest <= max(n * chunk, v * h)) == expect_small, probe.largest


def test_dispatch_and_bad_inputs():
    hidden, weight, targets, mask, *_ = make_case("masked")
    lp, ent = logprob_entropy(hidden, weight, targets, mask)          # CPU -> torch backend
    ref = naive_logprob_entropy(hidden, weight, targets, mask, 1.0)
    assert _max(lp, ref[0]) <= 1e-5 and _max(ent, ref[1]) <= 1e-5
    with pytest.raises(ValueError, match="backend"):
        logprob_entropy(hidden, weight, targets, options=LogprobOptions(backend="cuda"))
    with pytest.raises(ValueError, match="hidden size mismatch"):
        fused_logprob_entropy(hidden, weight[:, :-1], targets)
    with pytest.raises(ValueError, match=r"targets of unmasked tokens must lie in \[0, 202\)"):
        fused_logprob_entropy(hidden, weight, torch.full_like(targets, 202))
    with pytest.raises(ValueError, match="mask must be a bool"):
        fused_logprob_entropy(hidden, weight, targets, mask.float())
    with pytest.raises(ValueError, match="temperature"):
        fused_logprob_entropy(hidden, weight, targets, options=LogprobOptions(temperature=0.0))
    with pytest.raises(ValueError, match="share one float dtype"):
        fused_logprob_entropy(hidden.double(), weight, targets)
    with pytest.raises(ValueError, match=r"targets must be an int tensor of shape \[37\] or \[37, K\]"):
        fused_logprob_entropy(hidden, weight, targets[:, None, None])
    with pytest.raises(ValueError, match="triton backend takes one target per row"):
        logprob_entropy(hidden, weight, targets[:, None], options=LogprobOptions(backend="triton"))


def test_padded_vocab_bias_column():
    """Megatron's padded vocab rows removed by a (ones, 0 / -1e30) column pair, as the rollout
    scorer does: outputs and gradients equal the naive op on the unpadded vocabulary (logits of
    -1e30 stay finite through the online rescaling and the entropy terms)."""
    hidden, weight, targets, mask, ra, rb, chunk, temperature = make_case("temperature")
    vocab, pad = weight.shape[0], 30      # the padded rows fill the last chunk entirely
    padded = torch.cat([weight, torch.randn(pad, weight.shape[1])])
    bias = torch.cat([torch.zeros(vocab), torch.full((pad,), -1.0e30)])[:, None]

    def fused(h, w):
        h1 = torch.cat([h, torch.ones(h.shape[0], 1)], dim=1)
        return fused_logprob_entropy(h1, torch.cat([w, bias], dim=1), targets, mask,
                                     LogprobOptions(temperature=temperature, chunk_size=vocab))
    got = outputs_and_grads(fused, hidden, padded, ra, rb)
    ref = outputs_and_grads(lambda h, w: naive_logprob_entropy(h, w, targets, mask, temperature),
                            hidden, weight, ra, rb)
    assert _max(got[0], ref[0]) <= 1e-5 and _max(got[1], ref[1]) <= 1e-5
    assert _max(got[2], ref[2]) <= 1e-4 and _max(got[3][:vocab], ref[3]) <= 1e-4
    assert not got[3][vocab:].any()
