"""Triton forward for the fused log-prob / entropy op (same contract as ``fused_logprob``).

Forward: a grid of (row block, vocab split) programs; each walks its vocab range in BLOCK_V tiles,
computes the tile's logits with ``tl.dot`` over BLOCK_H slices of the hidden size, and keeps the
online (max, sum-exp, entropy term, target logit) per row in fp32. The per-split partials ([splits, n]
each) are merged in torch, and the tensor-parallel combination reuses ``combine_partials`` (the
all_reduces happen in Python). Nothing of size tokens x vocab is ever allocated: the forward holds
O(tokens) floats. Backward is the torch op's (``chunked_grads``): each vocab chunk's logits are
recomputed and its two gradient products run on the device's BLAS.

The measurements behind that split are in docs/MEASUREMENTS.md. This is the GPU path. On CPU it runs only under Triton's
interpreter (``TRITON_INTERPRET=1`` set before this module is imported), which is how it is tested;
the interpreter cannot run bf16 ``tl.dot`` (Triton 3.9 multiplies the raw uint16 bit patterns), so
bf16 is exercised only on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megarlhf.ops.fused_logprob import (NEG_BIG, LogprobOptions, Saved, apply_on_selected_rows, check_inputs,
                                        chunked_grads, combine_partials, normalised_options)


@dataclass(frozen=True)
class TritonBlocks:
    """The forward's tile sizes (each >= 16 and a power of two, as ``tl.dot`` needs), and how many programs
    to aim for when splitting the vocabulary."""

    block_n: int = 64
    block_v: int = 128
    block_h: int = 64
    target_programs: int = 1024

    def __post_init__(self):
        for name in ("block_n", "block_v", "block_h"):
            b = getattr(self, name)
            if b < 16 or b & (b - 1):
                raise ValueError(f"triton_logprob_entropy: {name} must be a power of two >= 16, got {b}")


@triton.jit
def _logits_tile(X, W, rows, cols, row_ok, col_ok, H, stride_x, stride_w,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                 PRECISION: tl.constexpr):
    """fp32 [BLOCK_N, BLOCK_V] tile of X @ W.T (X already divided by the temperature)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(X + rows[:, None] * stride_x + hs[None, :],
                    mask=row_ok[:, None] & (hs[None, :] < H), other=0.0)
        w = tl.load(W + cols[:, None] * stride_w + hs[None, :],
                    mask=col_ok[:, None] & (hs[None, :] < H), other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    return acc


@triton.jit
def _forward_kernel(X, W, LOCAL_T, IN_SHARD, M, S, A, TGT, n, V, H, stride_x, stride_w,
                    v_per_split, NEG_BIG: tl.constexpr, ENTROPY: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                    PRECISION: tl.constexpr):
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
                              BLOCK_N, BLOCK_V, BLOCK_H, PRECISION)
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


def _dot_precision(x: torch.Tensor) -> str:
    """fp32 inputs are multiplied in IEEE fp32: ``tl.dot``'s default rounds them to TF32 on Ampere and
    later (docs/MEASUREMENTS.md)."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _merge_splits(m, s, a, tgt):
    """Merges per-split partials [splits, n] into per-row partials [n] (same rescaling as TP)."""
    m_all = m.amax(dim=0)
    shift = m - m_all
    alpha = torch.exp(shift)
    return m_all, (alpha * s).sum(0), (alpha * (a + shift * s)).sum(0), tgt.sum(0)


class _TritonLogprobEntropy(torch.autograd.Function):
    """Triton forward, chunked BLAS backward, over the selected rows."""

    @staticmethod
    def forward(ctx, x, weight, local_t, in_shard, tp_size: int, options: LogprobOptions, blocks: TritonBlocks):
        temperature = options.temperature
        xs = (x / temperature if temperature != 1.0 else x).contiguous()
        weight_c = weight.contiguous()
        n, hid = xs.shape
        v = weight_c.shape[0]
        row_blocks = triton.cdiv(n, blocks.block_n)
        tiles = triton.cdiv(v, blocks.block_v)
        # enough programs to fill the device, each split a whole number of vocab tiles
        splits = max(1, min(tiles, triton.cdiv(blocks.target_programs, row_blocks)))
        v_per_split = triton.cdiv(tiles, splits) * blocks.block_v
        splits = triton.cdiv(v, v_per_split)
        parts = torch.empty((4, splits, n), dtype=torch.float32, device=xs.device)
        in_shard_i8 = in_shard.to(torch.int8)
        _forward_kernel[(row_blocks, splits)](
            xs, weight_c, local_t, in_shard_i8, parts[0], parts[1], parts[2], parts[3],
            n, v, hid, xs.stride(0), weight_c.stride(0), v_per_split,
            NEG_BIG=NEG_BIG, ENTROPY=options.compute_entropy, BLOCK_N=blocks.block_n, BLOCK_V=blocks.block_v,
            BLOCK_H=blocks.block_h, PRECISION=_dot_precision(xs))
        m, s, a, tgt = _merge_splits(*parts.unbind(0))
        logz, ent, logprob = combine_partials(m, s, a, tgt, options.tp_group, tp_size)
        ctx.save_for_backward(xs, weight_c, local_t, in_shard_i8, logz, ent)
        ctx.cfg = (options, tp_size)
        ctx.set_materialize_grads(False)
        return logprob, (ent if options.compute_entropy else ent.new_empty(0))

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        xs, weight, local_t, in_shard_i8, logz, ent = ctx.saved_tensors
        options, tp_size = ctx.cfg
        saved = Saved(xs, weight, local_t, in_shard_i8 != 0, logz, ent)
        grad_x, grad_w = chunked_grads(saved, g_lp, g_ent, ctx.needs_input_grad[:2], options, tp_size)
        return grad_x, grad_w, None, None, None, None, None


def triton_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           mask: torch.Tensor | None = None, options: LogprobOptions = LogprobOptions(),
                           blocks: TritonBlocks = TritonBlocks()):
    """Triton version of ``fused_logprob_entropy`` (same arguments, outputs and TP contract); ``blocks``:
    the forward's tiles. ``options.chunk_size``: vocab rows per chunk of the backward (its peak memory: a
    [tokens, chunk_size] fp32 gradient block)."""
    check_inputs(hidden, weight, targets, mask, options)
    options = normalised_options(options)

    def apply(x, local_t, in_shard, tp_size):
        return _TritonLogprobEntropy.apply(x, weight, local_t, in_shard, tp_size, options, blocks)
    return apply_on_selected_rows(apply, hidden, weight, targets, mask, options)
