"""Triton kernels for the fused log-prob / entropy op (same contract as ``fused_logprob``).

Forward: a grid of (row block, vocab split) programs; each walks its vocab range in BLOCK_V tiles,
computes the tile's logits with ``tl.dot`` over BLOCK_H slices of the hidden size, and keeps the
online (max, sum-exp, entropy term, target logit) per row in fp32. The per-split partials ([splits, n]
each) are merged in torch, and the tensor-parallel combination reuses ``combine_partials`` (the
all_reduces happen in Python). Backward: a grid of (row block, vocab tile) programs; each recomputes
its logits tile, forms dL/dlogits in fp32, and adds its contributions to grad_hidden (G @ W) and
grad_weight (G^T @ X) with fp32 atomic adds. Nothing of size tokens x vocab is ever allocated.

Hand-written for the same reason as ``fused_logprob`` (no library offers log-prob + entropy with
gradients for both, vocab-parallel); this is the GPU path. On CPU it runs only under Triton's
interpreter (``TRITON_INTERPRET=1`` set before this module is imported), which is how it is tested;
the interpreter cannot run bf16 ``tl.dot`` (Triton 3.9 multiplies the raw uint16 bit patterns), so
bf16 is exercised only on a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megarlhf.ops.fused_logprob import (NEG_BIG, apply_on_selected_rows, check_inputs,
                                        combine_partials)


@triton.jit
def _logits_tile(X, W, rows, cols, row_ok, col_ok, H, stride_x, stride_w,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    """fp32 [BLOCK_N, BLOCK_V] tile of X @ W.T (X already divided by the temperature)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(X + rows[:, None] * stride_x + hs[None, :],
                    mask=row_ok[:, None] & (hs[None, :] < H), other=0.0)
        w = tl.load(W + cols[:, None] * stride_w + hs[None, :],
                    mask=col_ok[:, None] & (hs[None, :] < H), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    return acc


@triton.jit
def _forward_kernel(X, W, LOCAL_T, IN_SHARD, M, S, A, TGT, n, V, H, stride_x, stride_w,
                    v_per_split, NEG_BIG: tl.constexpr, ENTROPY: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    local_t = tl.load(LOCAL_T + rows, mask=row_ok, other=-1)
    owns = tl.load(IN_SHARD + rows, mask=row_ok, other=0) != 0
    m = tl.full((BLOCK_N,), NEG_BIG, tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    a = tl.zeros((BLOCK_N,), tl.float32)
    tgt = tl.zeros((BLOCK_N,), tl.float32)
    v_lo = split * v_per_split
    v_hi = tl.minimum(v_lo + v_per_split, V)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_hi
        logits = _logits_tile(X, W, rows, cols, row_ok, col_ok, H, stride_x, stride_w,
                              BLOCK_N, BLOCK_V, BLOCK_H)
        hit = (cols[None, :] == local_t[:, None]) & owns[:, None] & col_ok[None, :]
        tgt += tl.sum(tl.where(hit, logits, 0.0), axis=1)
        # columns past the range hold 0 (masked loads): kept finite and given zero weight below
        m_new = tl.maximum(m, tl.max(tl.where(col_ok[None, :], logits, float("-inf")), axis=1))
        shift = m - m_new
        alpha = tl.exp(shift)
        shifted = logits - m_new[:, None]
        e = tl.where(col_ok[None, :], tl.exp(shifted), 0.0)
        if ENTROPY:
            a = alpha * (a + shift * s) + tl.sum(e * shifted, axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        m = m_new
    out = split * n + rows
    tl.store(M + out, m, mask=row_ok)
    tl.store(S + out, s, mask=row_ok)
    tl.store(A + out, a, mask=row_ok)
    tl.store(TGT + out, tgt, mask=row_ok)


@triton.jit
def _backward_kernel(X, W, LOCAL_T, IN_SHARD, LOGZ, ENT, G_LP, G_ENT, GX, GW, n, V, H,
                     stride_x, stride_w, HAS_G_ENT: tl.constexpr,
                     NEED_X: tl.constexpr, NEED_W: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_n, pid_v = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok, col_ok = rows < n, cols < V
    logits = _logits_tile(X, W, rows, cols, row_ok, col_ok, H, stride_x, stride_w,
                          BLOCK_N, BLOCK_V, BLOCK_H)
    log_p = logits - tl.load(LOGZ + rows, mask=row_ok, other=0.0)[:, None]
    p = tl.exp(log_p)
    g_lp = tl.load(G_LP + rows, mask=row_ok, other=0.0)
    coef = tl.zeros((BLOCK_N, BLOCK_V), tl.float32) + g_lp[:, None]
    if HAS_G_ENT:
        g_ent = tl.load(G_ENT + rows, mask=row_ok, other=0.0)
        ent = tl.load(ENT + rows, mask=row_ok, other=0.0)
        coef += g_ent[:, None] * (ent[:, None] + log_p)
    local_t = tl.load(LOCAL_T + rows, mask=row_ok, other=-1)
    owns = tl.load(IN_SHARD + rows, mask=row_ok, other=0) != 0
    hit = (cols[None, :] == local_t[:, None]) & owns[:, None]
    grad = tl.where(hit, g_lp[:, None], 0.0) - p * coef
    grad = tl.where(row_ok[:, None] & col_ok[None, :], grad, 0.0).to(X.dtype.element_ty)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_ok = hs < H
        if NEED_X:
            w = tl.load(W + cols[:, None] * stride_w + hs[None, :],
                        mask=col_ok[:, None] & h_ok[None, :], other=0.0)
            tl.atomic_add(GX + rows[:, None] * H + hs[None, :], tl.dot(grad, w),
                          mask=row_ok[:, None] & h_ok[None, :])
        if NEED_W:
            x = tl.load(X + rows[:, None] * stride_x + hs[None, :],
                        mask=row_ok[:, None] & h_ok[None, :], other=0.0)
            tl.atomic_add(GW + cols[:, None] * H + hs[None, :], tl.dot(tl.trans(grad), x),
                          mask=col_ok[:, None] & h_ok[None, :])


def _merge_splits(m, s, a, tgt):
    """Merges per-split partials [splits, n] into per-row partials [n] (same rescaling as TP)."""
    m_all = m.amax(dim=0)
    shift = m - m_all
    alpha = torch.exp(shift)
    return m_all, (alpha * s).sum(0), (alpha * (a + shift * s)).sum(0), tgt.sum(0)


class _TritonLogprobEntropy(torch.autograd.Function):
    """Triton forward/backward over the selected rows."""

    @staticmethod
    def forward(ctx, x, weight, local_t, in_shard, tp_group, tp_size, temperature, want_entropy,
                blocks):
        block_n, block_v, block_h, target_programs = blocks
        xs = (x / temperature if temperature != 1.0 else x).contiguous()
        weight_c = weight.contiguous()
        n, hid = xs.shape
        v = weight_c.shape[0]
        row_blocks = triton.cdiv(n, block_n)
        tiles = triton.cdiv(v, block_v)
        # enough programs to fill the device, each split a whole number of vocab tiles
        splits = max(1, min(tiles, triton.cdiv(target_programs, row_blocks)))
        v_per_split = triton.cdiv(tiles, splits) * block_v
        splits = triton.cdiv(v, v_per_split)
        parts = torch.empty((4, splits, n), dtype=torch.float32, device=xs.device)
        in_shard_i8 = in_shard.to(torch.int8)
        _forward_kernel[(row_blocks, splits)](
            xs, weight_c, local_t, in_shard_i8, parts[0], parts[1], parts[2], parts[3],
            n, v, hid, xs.stride(0), weight_c.stride(0), v_per_split,
            NEG_BIG=NEG_BIG, ENTROPY=want_entropy,
            BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_H=block_h)
        m, s, a, tgt = _merge_splits(*parts.unbind(0))
        logz, ent, logprob = combine_partials(m, s, a, tgt, tp_group, tp_size)
        ctx.save_for_backward(xs, weight_c, local_t, in_shard_i8, logz, ent)
        ctx.cfg = (tp_group, tp_size, temperature, blocks)
        ctx.set_materialize_grads(False)
        return logprob, (ent if want_entropy else ent.new_empty(0))

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        xs, weight, local_t, in_shard_i8, logz, ent = ctx.saved_tensors
        tp_group, tp_size, temperature, (block_n, block_v, block_h, _) = ctx.cfg
        if g_ent is not None and g_ent.numel() == 0:
            g_ent = None
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, hid = xs.shape
        v = weight.shape[0]
        gx = torch.zeros((n, hid), dtype=torch.float32, device=xs.device)
        gw = torch.zeros((v, hid) if need_w else (1, 1), dtype=torch.float32, device=xs.device)
        if (need_x or need_w) and (g_lp is not None or g_ent is not None):
            _backward_kernel[(triton.cdiv(n, block_n), triton.cdiv(v, block_v))](
                xs, weight, local_t, in_shard_i8, logz, ent,
                # a missing log-prob gradient is zeros (n floats); a missing entropy one is skipped
                torch.zeros_like(logz) if g_lp is None else g_lp.float().contiguous(),
                logz if g_ent is None else g_ent.float().contiguous(), gx, gw,
                n, v, hid, xs.stride(0), weight.stride(0), HAS_G_ENT=g_ent is not None,
                NEED_X=need_x, NEED_W=need_w,
                BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_H=block_h)
        grad_x = grad_w = None
        if need_x:
            if tp_size > 1:   # the copy_to_tensor_model_parallel_region backward, done here
                torch.distributed.all_reduce(gx, group=tp_group)
            grad_x = (gx / temperature).to(xs.dtype)
        if need_w:
            grad_w = gw.to(weight.dtype)
        return grad_x, grad_w, None, None, None, None, None, None, None


def triton_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           mask: torch.Tensor | None = None, *, tp_group=None,
                           temperature: float = 1.0, compute_entropy: bool = True,
                           block_n: int = 64, block_v: int = 128, block_h: int = 64,
                           target_programs: int = 1024, check_targets: bool = True):
    """Triton version of ``fused_logprob_entropy`` (same arguments, outputs and TP contract).

    block_* are the tile sizes (each >= 16, powers of two, as ``tl.dot`` needs); target_programs is
    how many forward programs to aim for when splitting the vocabulary.
    """
    check_inputs(hidden, weight, targets, mask, temperature, 1)
    for name, b in (("block_n", block_n), ("block_v", block_v), ("block_h", block_h)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"triton_logprob_entropy: {name} must be a power of two >= 16, got {b}")

    def apply(x, local_t, in_shard, tp_size):
        return _TritonLogprobEntropy.apply(x, weight, local_t, in_shard, tp_group, tp_size,
                                           float(temperature), bool(compute_entropy),
                                           (block_n, block_v, block_h, target_programs))
    return apply_on_selected_rows(apply, hidden, weight, targets, mask, tp_group, compute_entropy, check_targets)
