"""A teacher's view of each position: the top-k of its vocab-parallel distribution and the log-prob of
the sampled token, from hidden states, in one forward-only walk over the vocabulary.

For each selected row with logits ``l = hidden @ weight.T / temperature`` over the whole (TP-sharded)
vocabulary it returns

    target_logprob = l[t] - logsumexp(l)       topk = the K largest l[j] - logsumexp(l), descending, with j
    rest = log(sum of exp(l[j] - logsumexp(l)) over every j outside the top-K)

Each vocab chunk's top-K is merged into a running top-K (values and global ids), beside the online max /
sum-exp of :mod:`megarlhf.ops.fused_logprob`; nothing of size tokens x vocab is built. ``rest`` is the
log-sum-exp of the evicted logits themselves (:mod:`megarlhf.ops.rest_mass`), never 1 minus the top-K's
mass: that difference loses everything below fp32's resolution of the top-K log-probs (~1e-6 for logits of
20-30, where a confident model's rest is 1e-9). Under tensor parallelism every rank's top-K candidates are
all-gathered over ``tp_group`` (K values and ids per row and rank), the top-K of those TP x K candidates is
the top-K of the whole vocabulary, the candidates it evicts join the ranks' rests, and the log-sum-exp, the
rests and the target logit are combined as the log-prob op combines them. Outputs are identical on every TP
rank. Megatron's padded vocabulary rows must carry a -1e30 logit (:func:`megarlhf.learner.forward.
mask_padded_vocab`), and K must not exceed the real vocabulary, or padded rows would enter the top-K.

Forward only: a teacher is frozen, and the student's log-probs at the teacher's ids come from the
log-prob op with [N, K] targets, which has gradients.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarlhf.ops.fused_logprob import (LogprobOptions, check_inputs, chunk_logits, combine_partials, scatter_rows,
                                        select_rows, tp_rank_and_size)
from megarlhf.ops.rest_mass import NEG_BIG, RunningLogSumExp, combine_rest, inside


def _dropped(values: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """[n, c] bool: the columns of ``values`` that ``kept`` (indices per row) does not hold."""
    return ~inside(tuple(values.shape), kept, torch.ones_like(kept, dtype=torch.bool))


def _local_topk(x: torch.Tensor, weight: torch.Tensor, local_t: torch.Tensor, in_shard: torch.Tensor, k: int,
                vocab_start: int, chunk_size: int):
    """One pass over this rank's shard: running max, sum-exp, target logit, top-K (values, global ids) and the
    log-sum-exp of everything evicted from it (:class:`~megarlhf.ops.rest_mass.RunningLogSumExp`)."""
    n = x.shape[0]
    m = x.new_full((n,), NEG_BIG, dtype=torch.float32)
    s = torch.zeros_like(m)
    tgt = torch.zeros_like(m)
    evicted = RunningLogSumExp(n, x.device)
    top_values = x.new_full((n, k), NEG_BIG, dtype=torch.float32)  # placeholders: never counted, always evicted
    top_ids = torch.zeros((n, k), dtype=torch.long, device=x.device)
    for lo in range(0, weight.shape[0], chunk_size):
        hi = min(lo + chunk_size, weight.shape[0])
        logits = chunk_logits(x, weight, lo, hi)
        hit = in_shard & (local_t >= lo) & (local_t < hi)
        tgt += torch.where(hit, logits.gather(1, (local_t - lo).clamp(0, hi - lo - 1)[:, None]).squeeze(1), 0.0)
        m_new = torch.maximum(m, logits.amax(dim=1))
        s = torch.exp(m - m_new) * s + torch.exp(logits - m_new[:, None]).sum(dim=1)
        m = m_new
        chunk_values, chunk_where = torch.topk(logits, min(k, hi - lo), dim=1)  # the chunk's own top first
        evicted.add(logits, _dropped(logits, chunk_where))
        candidates = torch.cat([top_values, chunk_values], dim=1)
        top_values, where = torch.topk(candidates, k, dim=1)
        evicted.add(candidates, _dropped(candidates, where))
        top_ids = torch.cat([top_ids, chunk_where + vocab_start + lo], dim=1).gather(1, where)
    return m, s, evicted.value(), tgt, top_values, top_ids


def _merge_ranks(top_values: torch.Tensor, top_ids: torch.Tensor, k: int, tp_group, tp_size: int):
    """The top-K of every TP rank's top-K candidates (all-gathered over ``tp_group``), and the log-sum-exp of the
    candidates it evicts (the same on every rank; None at TP 1)."""
    if tp_size == 1:
        return top_values, top_ids, None
    values = [torch.empty_like(top_values) for _ in range(tp_size)]
    ids = [torch.empty_like(top_ids) for _ in range(tp_size)]
    dist.all_gather(values, top_values.contiguous(), group=tp_group)
    dist.all_gather(ids, top_ids.contiguous(), group=tp_group)
    candidates = torch.cat(values, dim=1)
    merged, where = torch.topk(candidates, k, dim=1)
    evicted = RunningLogSumExp(len(candidates), candidates.device)
    evicted.add(candidates, _dropped(candidates, where))
    return merged, torch.cat(ids, dim=1).gather(1, where), evicted.value()


@torch.no_grad()
def topk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None,
                  k: int, options: LogprobOptions = LogprobOptions()):
    """(target log-probs [N], top-K log-probs [N, K] descending, their global vocab ids [N, K], the log of the
    probability outside the top-K [N]), fp32 / int64; the last is -inf where nothing lies outside (K = V).

    hidden [N, H]; weight [V_local, H] (this rank's shard); targets [N] global ids; mask [N] bool (False
    rows cost nothing and return 0 and id 0; the rest is 0 there too). ``options``: ``tp_group``, ``temperature``, ``chunk_size``,
    ``check_targets``, ``selected`` as for :func:`megarlhf.ops.logprob_entropy` (entropy is not computed).
    """
    check_inputs(hidden, weight, targets, mask, options)
    if targets.dim() != 1:
        raise ValueError(f"topk_logprobs: targets must be [N], got shape {tuple(targets.shape)}")
    rank, tp_size = tp_rank_and_size(options.tp_group)
    v_local = weight.shape[0]
    if not isinstance(k, int) or not 1 <= k <= v_local * tp_size:
        raise ValueError(f"topk_logprobs: k must be an int in [1, {v_local * tp_size}] (the vocabulary), got {k!r}")
    idx, x, local_t, in_shard = select_rows(hidden, targets, mask, rank * v_local, v_local, v_local * tp_size,
                                             options.check_targets, options.selected)
    n = hidden.shape[0]
    if x.shape[0] == 0:  # nothing selected (identical on all TP ranks): no work, no collectives
        zeros = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        return (zeros, torch.zeros((n, k), dtype=torch.float32, device=hidden.device),
                torch.zeros((n, k), dtype=torch.long, device=hidden.device), zeros.clone())
    temperature = float(options.temperature)
    xs = x / temperature if temperature != 1.0 else x
    m, s, rest, tgt, top_values, top_ids = _local_topk(xs, weight, local_t, in_shard, k, rank * v_local,
                                                       int(options.chunk_size))
    logz, _, target_logprob = combine_partials(m, s, torch.zeros_like(s), tgt, options.tp_group, tp_size)
    top_values, top_ids, merged_away = _merge_ranks(top_values, top_ids, k, options.tp_group, tp_size)
    # every rank's evicted logits (combined over the ranks), and those the merge of their top-K evicted (alike on each)
    rest = combine_rest(rest, logz, options.tp_group, tp_size, common=merged_away)
    return (scatter_rows(target_logprob, idx, n), scatter_rows(top_values - logz[:, None], idx, n),
            scatter_rows(top_ids, idx, n), scatter_rows(rest, idx, n))
