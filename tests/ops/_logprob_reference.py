"""Naive reference for the fused log-prob op (full logits -> log_softmax -> gather; entropy from the
full softmax) and the shared test cases, used in-process and by the torchrun workers."""
from __future__ import annotations

import torch

# name -> (tokens, hidden, vocab over all TP ranks, chunk, temperature, masked fraction)
# vocab is even (it is split over 2 TP ranks) and never a multiple of the chunk.
CASES = {
    "masked": (37, 24, 202, 50, 1.0, 0.3),
    "temperature": (29, 40, 202, 32, 0.7, 0.0),
    "chunk_exceeds_vocab": (16, 24, 90, 128, 1.3, 0.2),
    "single_token": (1, 24, 202, 64, 1.0, 0.0),
    "all_masked": (12, 24, 202, 50, 1.0, 1.0),
}


def make_case(name: str, dtype=torch.float32, seed: int = 0, targets_per_row: int | None = None):
    """Returns hidden, full weight, targets, mask, loss weights (ra, rb), chunk, temperature; with
    ``targets_per_row`` = K the targets (and ra, the log-probs' loss weights) are [N, K]."""
    n, h, v, chunk, temperature, masked = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * (1.5 / h ** 0.5)   # logits of std ~1.5
    shape = (n,) if targets_per_row is None else (n, targets_per_row)
    targets = torch.randint(0, v, shape, generator=gen)
    mask = None if masked == 0.0 else torch.rand(n, generator=gen) >= masked
    if masked == 1.0:
        targets[:] = -100   # masked tokens may carry any id (an ignore index, here)
    ra, rb = torch.randn(shape, generator=gen), torch.randn(n, generator=gen)
    return hidden.to(dtype), weight.to(dtype), targets, mask, ra, rb, chunk, temperature


def naive_logprob_entropy(hidden, weight, targets, mask, temperature, rest_from=None):
    """fp32 log-probs ([N], or [N, K] for targets [N, K]) and entropies [N] from the full logits; masked
    rows are 0. With ``rest_from`` one more column: the log-probability outside targets[:, rest_from:] (the
    log-sum-exp of the other logits, less the whole one's)."""
    logits = (hidden.float() @ weight.float().t()) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    safe_t = targets.clamp(0, weight.shape[0] - 1)
    logprob = logp.gather(1, safe_t.reshape(len(safe_t), -1)).reshape(targets.shape)
    if rest_from is not None:
        outside = logits.scatter(1, safe_t[:, rest_from:], float("-inf"))
        rest = torch.logsumexp(outside, dim=-1) - torch.logsumexp(logits, dim=-1)
        logprob = torch.cat([logprob, rest[:, None]], dim=1)
    if mask is not None:
        logprob, entropy = logprob * mask.view(-1, *[1] * (logprob.dim() - 1)), entropy * mask
    return logprob, entropy


def outputs_and_grads(fn, hidden, weight, ra, rb):
    """Runs fn(hidden, weight) -> (logprob, entropy|None) and backprops sum(ra*lp + rb*ent)."""
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    logprob, entropy = fn(hidden, weight)
    loss = (ra * logprob).sum() + (0.0 if entropy is None else (rb * entropy).sum())
    loss.backward()
    return logprob.detach(), (None if entropy is None else entropy.detach()), hidden.grad, weight.grad


def naive_topk(hidden, weight, targets, mask, temperature, k):
    """The target's log-prob [N], the top-k log-probs and ids [N, k] from the full log-softmax, and the log of the
    probability outside the top-k [N] (float64 from the fp32 logits; -inf when there is none); masked rows 0 and
    id 0."""
    logits = (hidden.float() @ weight.float().t()) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    target = logp.gather(1, targets.clamp(0, weight.shape[0] - 1)[:, None]).squeeze(1)
    values, ids = torch.topk(logp, k, dim=1)
    exact = logits.double()
    rest = (torch.logsumexp(exact.scatter(1, ids, float("-inf")), dim=-1) - torch.logsumexp(exact, dim=-1)).float()
    if mask is not None:
        target, values, ids = target * mask, values * mask[:, None], ids * mask[:, None]
        rest = torch.where(mask, rest, 0.0)
    return target, values, ids, rest
