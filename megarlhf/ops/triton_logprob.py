"""Triton forward for the fused log-prob / entropy op (same contract as ``fused_logprob``).

Forward: a grid of (row block, vocab split) programs; each walks its vocab range in BLOCK_V tiles,
computes the tile's logits with ``tl.dot`` over BLOCK_H slices of the hidden size, and keeps the
online (max, sum-exp, entropy term, target logit) per row in fp32. The per-split partials ([splits, n]
each) are merged in torch, and the tensor-parallel combination reuses ``combine_partials`` (the
all_reduces happen in Python). Nothing of size tokens x vocab is ever allocated: the forward holds
O(tokens) floats. Backward is the torch op's (``chunked_grads``): each vocab chunk's logits are
recomputed and its two gradient products run on the device's BLAS.

Why that split (bench/bench_logprob_backends.py, H200, 8192 tokens, bf16): the Triton forward took
3.1 ms against the torch op's 6.2 ms at hidden 2048 / vocab 32768 and 7.0 against 23.7 ms at hidden 1024
/ vocab 151,936, in 2 MiB instead of 448 MiB (forward only: scoring; a training step's peak is the
backward's, the same for both); a Triton backward that added its tiles' products into the
gradients with fp32 atomics took 84 and 187 ms against the chunked BLAS backward's 12 and 48 ms, and
was removed. fp32 inputs are multiplied in IEEE fp32 (``tl.dot`` would round them to TF32), where cuBLAS
is faster: the dispatcher (``megarlhf.ops.logprob_entropy``) sends fp32 to the torch op.

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

from megarlhf.ops.fused_logprob import (NEG_BIG, apply_on_selected_rows, check_inputs, chunked_grads,
                                        combine_partials)


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
    later (GPU check: HF vs Megatron fp32 log-probs 1.4e-3 nats apart on an H100 with TF32, 9.5e-7
    on an H200 with IEEE)."""
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
    def forward(ctx, x, weight, local_t, in_shard, tp_group, tp_size, temperature, want_entropy,
                blocks, chunk_size):
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
            BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_H=block_h, PRECISION=_dot_precision(xs))
        m, s, a, tgt = _merge_splits(*parts.unbind(0))
        logz, ent, logprob = combine_partials(m, s, a, tgt, tp_group, tp_size)
        ctx.save_for_backward(xs, weight_c, local_t, in_shard_i8, logz, ent)
        ctx.cfg = (tp_group, tp_size, temperature, chunk_size)
        ctx.set_materialize_grads(False)
        return logprob, (ent if want_entropy else ent.new_empty(0))

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        xs, weight, local_t, in_shard_i8, logz, ent = ctx.saved_tensors
        tp_group, tp_size, temperature, chunk_size = ctx.cfg
        grad_x, grad_w = chunked_grads(xs, weight, local_t, in_shard_i8 != 0, logz, ent, g_lp, g_ent,
                                       ctx.needs_input_grad[:2], chunk_size, tp_group, tp_size, temperature)
        return grad_x, grad_w, None, None, None, None, None, None, None, None


def triton_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           mask: torch.Tensor | None = None, *, tp_group=None,
                           temperature: float = 1.0, compute_entropy: bool = True,
                           block_n: int = 64, block_v: int = 128, block_h: int = 64,
                           target_programs: int = 1024, check_targets: bool = True, chunk_size: int = 4096):
    """Triton version of ``fused_logprob_entropy`` (same arguments, outputs and TP contract).

    block_* are the tile sizes (each >= 16, powers of two, as ``tl.dot`` needs); target_programs is
    how many forward programs to aim for when splitting the vocabulary. ``chunk_size``: vocab rows per
    chunk of the backward (its peak memory: a [tokens, chunk_size] fp32 gradient block).
    """
    check_inputs(hidden, weight, targets, mask, temperature, chunk_size)
    for name, b in (("block_n", block_n), ("block_v", block_v), ("block_h", block_h)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"triton_logprob_entropy: {name} must be a power of two >= 16, got {b}")

    def apply(x, local_t, in_shard, tp_size):
        return _TritonLogprobEntropy.apply(x, weight, local_t, in_shard, tp_group, tp_size,
                                           float(temperature), bool(compute_entropy),
                                           (block_n, block_v, block_h, target_programs), int(chunk_size))
    return apply_on_selected_rows(apply, hidden, weight, targets, mask, tp_group, compute_entropy, check_targets)
