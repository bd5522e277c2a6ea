"""Fused, vocab-parallel token log-probs and entropy from hidden states (torch; runs on any device).

Computes, for each selected token i with target t_i and logits l_i = hidden_i @ weight.T / temperature,

    logprob_i = l_i[t_i] - logsumexp(l_i)          entropy_i = logsumexp(l_i) - sum_j p_ij l_ij

without ever holding tokens x vocab logits: the vocabulary is walked in chunks with an online
(flash-softmax style) running max ``m``, sum ``s = sum exp(l - m)`` and entropy term
``a = sum exp(l - m) * (l - m)``; entropy = log s - a / s. Backward recomputes each chunk's logits
from the saved hidden rows and weight (nothing of size tokens x vocab is saved) and forms

    dL/dl_ij = g_lp_i * (1[j = t_i] - p_ij) - g_ent_i * p_ij * (H_i + log p_ij)

for upstream gradients g_lp (log-probs) and g_ent (entropy).

Neither Megatron-Core (its vocab-parallel cross-entropy needs the full local logits) nor a pinned
library offers a chunked log-prob + entropy with gradients for both.

Tensor parallelism (Megatron's layout): ``weight`` is this rank's shard of the padded vocabulary,
rank r holding rows ``[r * V_local, (r + 1) * V_local)``; ``targets`` are global ids. Each rank reduces
its shard to (max, sum-exp, entropy term, target logit) per token, and these are combined over
``tp_group`` as Megatron's vocab-parallel cross-entropy does: all_reduce MAX of the max, then one
all_reduce SUM of the rescaled partials. Outputs are identical on every TP rank.

Gradient contract under TP: pass the hidden states exactly as Megatron's output layer
(ColumnParallelLinear) sees them, i.e. the full, replicated hidden rows (no sequence parallelism).
The op itself plays the role of ``copy_to_tensor_model_parallel_region``: in backward it all-reduces
(SUM over ``tp_group``) the hidden-state gradient, so the returned grad_hidden is the full gradient,
identical on every rank, and the caller must NOT all-reduce it again. grad_weight is this rank's
shard only. ``mask`` (and therefore the selected rows) must be identical on all TP ranks.

Logits must be finite: to drop vocab rows (Megatron's padding) give them a large finite negative
logit such as -1e30 (it contributes exactly 0); -inf would turn the entropy terms into 0 * inf.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.distributed as dist

from megarlhf.ops.rest_mass import NEG_BIG, RunningLogSumExp, combine_rest, inside, rest_grad_

# NEG_BIG, the initial running max for the online pass: finite so that (m_old - m_new) * s stays 0 * finite
# (with -inf it would be -inf * 0 = nan) and exp(m_old - m_new) is exactly 0.


@dataclass(frozen=True)
class LogprobOptions:
    """How the op runs. ``tp_group``: the tensor-parallel group the vocabulary is sharded over (None: all of
    it on this rank); logits are divided by ``temperature``; the vocabulary is walked ``chunk_size`` rows at a
    time; ``compute_entropy=False`` returns no entropies; ``check_targets=False`` skips the targets' range
    check (one device read) for a caller that made it; ``backend`` is :func:`megarlhf.ops.logprob_entropy`'s
    choice: "auto" (Triton for bf16/fp16 CUDA inputs when importable, else torch), "torch" or "triton"."""

    tp_group: object = None
    temperature: float = 1.0
    chunk_size: int = 4096
    compute_entropy: bool = True
    check_targets: bool = True
    backend: str = "auto"
    # how many mask entries are true, when the caller knows it on the host: the rows are then picked without
    # waiting for the device (nonzero_static instead of nonzero)
    selected: int | None = None
    # [N, K] targets only: the log-probs get one more column, log of the probability outside targets[:, rest_from:]
    # (a distillation loss's "rest of the vocabulary" beside a teacher's top-k), summed from its own small terms
    rest_from: int | None = None


class Saved(NamedTuple):
    """What the forward keeps for the backward (the selected rows only)."""

    xs: torch.Tensor  # hidden rows divided by the temperature
    weight: torch.Tensor
    local_t: torch.Tensor
    in_shard: torch.Tensor
    logz: torch.Tensor
    ent: torch.Tensor
    log_rest: torch.Tensor | None = None  # options.rest_from: log of the probability outside those targets


def check_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                 mask: torch.Tensor | None, options: LogprobOptions) -> None:
    """Raises ValueError naming the argument whose shape, dtype or value is wrong."""
    temperature, chunk_size = options.temperature, options.chunk_size
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"logprob op: hidden must be [N, H] and weight [V_local, H]; got hidden "
                         f"{tuple(hidden.shape)}, weight {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"logprob op: hidden size mismatch: hidden {tuple(hidden.shape)} vs weight "
                         f"{tuple(weight.shape)}")
    if hidden.dtype != weight.dtype or not hidden.is_floating_point():
        raise ValueError(f"logprob op: hidden and weight must share one float dtype; got "
                         f"{hidden.dtype} and {weight.dtype}")
    if hidden.device != weight.device:
        raise ValueError(f"logprob op: hidden on {hidden.device} but weight on {weight.device}")
    one_per_row = targets.dim() == 1 or (targets.dim() == 2 and targets.shape[1] >= 1)
    if (not one_per_row or targets.shape[0] != hidden.shape[0]
            or targets.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"logprob op: targets must be an int tensor of shape [{hidden.shape[0]}] or "
                         f"[{hidden.shape[0]}, K]; got {targets.dtype} {tuple(targets.shape)}")
    if mask is not None and (mask.shape != (hidden.shape[0],) or mask.dtype != torch.bool):
        raise ValueError(f"logprob op: mask must be a bool tensor of shape [{hidden.shape[0]}]; "
                         f"got {mask.dtype} {tuple(mask.shape)}")
    if not temperature > 0:
        raise ValueError(f"logprob op: temperature must be > 0, got {temperature}")
    if options.rest_from is not None and not (targets.dim() == 2 and 0 <= options.rest_from < targets.shape[1]):
        raise ValueError(f"logprob op: rest_from={options.rest_from} needs [N, K] targets with rest_from < K; got "
                         f"targets of shape {tuple(targets.shape)}")
    if chunk_size < 1:
        raise ValueError(f"logprob op: chunk_size must be >= 1, got {chunk_size}")


def tp_rank_and_size(tp_group) -> tuple[int, int]:
    """(rank, size) in ``tp_group``; (0, 1) when there is no group."""
    if tp_group is None:
        return 0, 1
    return dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)


def select_rows(hidden: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None,
                 vocab_start: int, vocab_local: int, vocab_total: int, check_targets: bool = True,
                 selected: int | None = None):
    """Picks the unmasked rows (``selected`` of them, when known on the host); returns (rows index or None,
    hidden rows, local targets, in-shard).

    Local targets are ``target - vocab_start``, set to 0 where the target lives on another rank;
    ``in_shard`` says which rows own their target here.
    """
    idx = None
    if mask is not None:
        idx = (mask.nonzero() if selected is None else torch.nonzero_static(mask, size=selected)).squeeze(1)
        hidden, targets = hidden[idx], targets[idx]
    # a host read: a caller that checked its targets already (the trainer, once per pass) turns it off
    if check_targets and targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_total):
        raise ValueError(f"logprob op: targets of unmasked tokens must lie in [0, {vocab_total}) "
                         f"(the padded vocab over all TP ranks); got range "
                         f"[{int(targets.min())}, {int(targets.max())}]")
    local = targets.long() - vocab_start
    in_shard = (local >= 0) & (local < vocab_local)
    return idx, hidden, torch.where(in_shard, local, 0).contiguous(), in_shard


def scatter_rows(values: torch.Tensor, idx: torch.Tensor | None, n: int) -> torch.Tensor:
    """Puts per-selected-row values ([rows] or [rows, K]) back at their token positions; masked tokens get 0."""
    if idx is None:
        return values
    return values.new_zeros((n, *values.shape[1:])).index_put((idx,), values)


def apply_on_selected_rows(apply, hidden, weight, targets, mask, options: LogprobOptions):
    """Runs ``apply(x, local_t, in_shard, tp_size) -> (logprob, entropy)`` on the unmasked rows only.

    Shared by the torch and Triton backends: row selection, target localisation to this rank's
    vocab shard, the all-masked shortcut, and scattering results back to [N] (masked rows = 0).
    """
    compute_entropy, check_targets = options.compute_entropy, options.check_targets
    rank, tp_size = tp_rank_and_size(options.tp_group)
    v_local = weight.shape[0]
    idx, x, local_t, in_shard = select_rows(hidden, targets, mask, rank * v_local, v_local,
                                             v_local * tp_size, check_targets, options.selected)
    n = hidden.shape[0]
    if x.shape[0] == 0:   # nothing selected (identical on all TP ranks): no work, no collectives
        # zeros that still hang off the graph, so a loss built only from them can backward (to 0)
        tie = (hidden[:0].sum() + weight[:0].sum()).float()
        shape = (n, targets.shape[1] + 1) if options.rest_from is not None else tuple(targets.shape)
        logprob = hidden.new_zeros(shape, dtype=torch.float32) + tie
        return logprob, (hidden.new_zeros(n, dtype=torch.float32) + tie if compute_entropy else None)
    logprob, ent = apply(x, local_t, in_shard, tp_size)
    return scatter_rows(logprob, idx, n), (scatter_rows(ent, idx, n) if compute_entropy else None)


def combine_partials(m: torch.Tensor, s: torch.Tensor, a: torch.Tensor, tgt: torch.Tensor,
                     tp_group, tp_size: int):
    """Turns this rank's (max, sum-exp, entropy term, target logit) into global (logZ, entropy, logprob);
    ``tgt`` is [N] (one target per row) or [N, K] (K targets per row: the log-probs are [N, K]).

    Megatron's order: all_reduce MAX of the max, rescale the partials to it, one all_reduce SUM.
    Rescaling ``a`` uses sum exp(l - M) (l - M) = e^(m - M) (a + (m - M) s).
    """
    if tp_size > 1:
        m_glob = m.clone()
        dist.all_reduce(m_glob, op=dist.ReduceOp.MAX, group=tp_group)
        shift = m - m_glob
        alpha = torch.exp(shift)
        packed = torch.cat([(alpha * s)[:, None], (alpha * (a + shift * s))[:, None], tgt.reshape(len(m), -1)], 1)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
        m, s, a, tgt = m_glob, packed[:, 0], packed[:, 1], packed[:, 2:].reshape(tgt.shape)
    log_s = torch.log(s)
    logz = m + log_s
    return logz, log_s - a / s, tgt - logz.view(-1, *[1] * (tgt.dim() - 1))


def chunk_logits(x: torch.Tensor, weight: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """fp32 logits of one vocab chunk (x is already divided by the temperature)."""
    return torch.mm(x, weight[lo:hi].t()).float()


def _local_partials(x, weight, local_t, in_shard, chunk_size: int, want_entropy: bool, rest_from: int | None = None):
    """One pass over this rank's vocab shard: running max, sum-exp, entropy term, target logit(s) (``local_t``
    [N] or [N, K]) and, with ``rest_from``, the log-sum-exp of the logits outside the targets from that column on
    (:mod:`megarlhf.ops.rest_mass`; else None)."""
    n = x.shape[0]
    m = x.new_full((n,), NEG_BIG, dtype=torch.float32)
    s = torch.zeros_like(m)
    a = torch.zeros_like(m)
    rest = None if rest_from is None else RunningLogSumExp(n, x.device)
    tgt = torch.zeros(local_t.shape, dtype=torch.float32, device=x.device)
    for lo in range(0, weight.shape[0], chunk_size):
        hi = min(lo + chunk_size, weight.shape[0])
        logits = chunk_logits(x, weight, lo, hi)
        hit = in_shard & (local_t >= lo) & (local_t < hi)
        columns = (local_t - lo).clamp(0, hi - lo - 1).reshape(n, -1)
        tgt += torch.where(hit, logits.gather(1, columns).reshape(local_t.shape), 0.0)
        if rest is not None:  # before the logits are shifted in place
            rest.add(logits, ~inside(tuple(logits.shape), columns[:, rest_from:], hit[:, rest_from:]))
        m_new = torch.maximum(m, logits.amax(dim=1))
        shift = m - m_new
        alpha = torch.exp(shift)
        shifted = logits.sub_(m_new[:, None])           # logits - m_new, in place
        e = torch.exp(shifted)
        s_chunk = e.sum(dim=1)
        if want_entropy:
            a = alpha * (a + shift * s) + e.mul_(shifted).sum(dim=1)
        s = alpha * s + s_chunk
        m = m_new
    return m, s, a, tgt, (None if rest is None else rest.value())


def _grad_logits_(logits, logz, g_lp, g_ent, ent):
    """Turns fp32 chunk logits (in place) into dL/dlogits without the target one-hot term.

    -p * (g_lp + g_ent * (H + log p)) with log p = logits - logZ, written as
    p * (log p * (-g_ent) - (g_lp + g_ent * H)) so that it takes three passes over the chunk.
    """
    log_p = logits.sub_(logz[:, None])
    p = torch.exp(log_p)
    if g_ent is None:
        return p.mul_(-g_lp[:, None]) if g_lp is not None else p.zero_()
    bias = g_ent * ent if g_lp is None else g_lp + g_ent * ent
    return log_p.mul_(-g_ent[:, None]).sub_(bias[:, None]).mul_(p)


def chunked_grads(saved: Saved, g_lp, g_ent, needs: tuple[bool, bool], options: LogprobOptions, tp_size: int):
    """(grad_x or None, grad_w or None) of the selected rows, recomputing logits one vocab chunk at a time.

    Each chunk is two matrix products on the device's BLAS (dL/dlogits @ W and its transpose @ X) after
    the elementwise gradient; shared by the torch and Triton backends. ``needs`` says which gradients
    autograd wants; under TP the hidden gradient is all-reduced here (see the module docstring).
    """
    xs, weight, local_t, in_shard, logz, ent, log_rest = saved
    chunk_size, rest_from = options.chunk_size, options.rest_from
    if g_ent is not None and g_ent.numel() == 0:
        g_ent = None
    need_x, need_w = needs
    grad_x = torch.zeros(xs.shape, dtype=torch.float32, device=xs.device) if need_x else None
    grad_w = torch.empty_like(weight) if need_w else None
    n = xs.shape[0]
    g_lp32 = None if g_lp is None else g_lp.float().reshape(n, -1)  # [N, K] (K = 1: one target per row)
    g_rest = None
    if g_lp32 is not None and log_rest is not None:  # the last column is the rest's log-prob
        g_lp32, g_rest = g_lp32[:, :-1], g_lp32[:, -1]
    g_row = None if g_lp32 is None else g_lp32.sum(dim=1)  # every target's log-prob shares the -p term

    g_ent32 = None if g_ent is None else g_ent.float()
    local_t, in_shard = local_t.reshape(n, -1), in_shard.reshape(n, -1)
    for lo in range(0, weight.shape[0], chunk_size):
        hi = min(lo + chunk_size, weight.shape[0])
        logits = chunk_logits(xs, weight, lo, hi)
        hit = None if g_lp32 is None else in_shard & (local_t >= lo) & (local_t < hi)
        columns = None if hit is None else torch.where(hit, local_t - lo, 0)
        rest_part = None if g_rest is None else rest_grad_(logits - logz[:, None], g_rest, log_rest,
                                                           columns[:, rest_from:], hit[:, rest_from:])
        grad = _grad_logits_(logits, logz, g_row, g_ent32, ent)
        del logits  # its buffer is grad's or free: the name must not hold a second chunk through the products
        if hit is not None:  # each target column gets +g_lp (a scatter: no boolean mask, no sync)
            grad.scatter_add_(1, columns, torch.where(hit, g_lp32, 0.0))
        if rest_part is not None:
            grad += rest_part
            del rest_part
        grad = grad.to(weight.dtype)
        if need_x:
            grad_x += torch.mm(grad, weight[lo:hi]).float()
        if need_w:
            torch.mm(grad.t(), xs, out=grad_w[lo:hi])
    if need_x:
        if tp_size > 1:   # the copy_to_tensor_model_parallel_region backward, done here
            dist.all_reduce(grad_x, group=options.tp_group)
        grad_x = (grad_x / options.temperature).to(xs.dtype)
    return grad_x, grad_w


class _FusedLogprobEntropy(torch.autograd.Function):
    """Chunked forward/backward over selected rows; see the module docstring for the math."""

    @staticmethod
    def forward(ctx, x, weight, local_t, in_shard, tp_size: int, options: LogprobOptions):
        temperature = options.temperature
        xs = x / temperature if temperature != 1.0 else x
        m, s, a, tgt, rest = _local_partials(xs, weight, local_t, in_shard, options.chunk_size,
                                             options.compute_entropy, options.rest_from)
        logz, ent, logprob = combine_partials(m, s, a, tgt, options.tp_group, tp_size)
        saved = [xs, weight, local_t, in_shard, logz, ent]
        if rest is not None:
            log_rest = combine_rest(rest, logz, options.tp_group, tp_size)
            logprob = torch.cat([logprob, log_rest[:, None]], dim=1)
            saved.append(log_rest)
        ctx.save_for_backward(*saved)
        ctx.cfg = (options, tp_size)
        ctx.set_materialize_grads(False)
        return logprob, (ent if options.compute_entropy else ent.new_empty(0))

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        options, tp_size = ctx.cfg
        grad_x, grad_w = chunked_grads(Saved(*ctx.saved_tensors), g_lp, g_ent, ctx.needs_input_grad[:2], options,
                                       tp_size)
        return grad_x, grad_w, None, None, None, None


def normalised_options(options: LogprobOptions) -> LogprobOptions:
    """``options`` with plain Python numbers (an autograd function keeps them; a tensor there would be read)."""
    return replace(options, temperature=float(options.temperature), chunk_size=int(options.chunk_size),
                   compute_entropy=bool(options.compute_entropy))


def fused_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          mask: torch.Tensor | None = None, options: LogprobOptions = LogprobOptions()):
    """Token log-probs [N] and entropies [N] (fp32) of ``targets`` under hidden @ weight.T / temperature.

    hidden [N, H]; weight [V_local, H] (this rank's vocab shard, Megatron layout); targets [N] global
    vocab ids, or [N, K] for K log-probs per row (returned [N, K]; one vocab pass for all of them; with
    ``options.rest_from`` [N, K + 1], the last column the log-probability outside ``targets[:, rest_from:]``);
    mask [N] bool (False rows cost nothing, return 0 and receive no gradient).
    Returns (logprobs, entropy or None). fp32/bf16/fp16 inputs; statistics are accumulated in fp32.
    Under TP the hidden gradient is all-reduced inside the op (see module docstring).
    """
    check_inputs(hidden, weight, targets, mask, options)
    options = normalised_options(options)

    def apply(x, local_t, in_shard, tp_size):
        return _FusedLogprobEntropy.apply(x, weight, local_t, in_shard, tp_size, options)
    return apply_on_selected_rows(apply, hidden, weight, targets, mask, options)
