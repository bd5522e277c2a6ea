"""The fingerprint of :mod:`megarlhf.rollout.engines.fingerprint` as Triton kernels (the GPU path): one launch per
tensor, or one launch for many staged tensors.

The torch formulation launches about a dozen small kernels per tensor and per chunk (product, row sum,
row weights, weighted sum); a model has hundreds of tensors, so on a GPU the launches, not the bytes,
set its time. Here each program reads a block of rows of 64 words, multiplies them by
the column weights, sums the rows, weights each row sum by its row's two odd weights and adds its two
partial sums into the tensor's fingerprint with integer atomics. All arithmetic is in uint32, which
wraps modulo ``2**32`` exactly as the torch path's int32 does, and integer addition does not depend on
the order the programs finish in: the result is bit-identical to the torch path's (tested under
Triton's CPU interpreter and on a GPU). What is left of its time is mostly the host's per-launch work,
one launch per tensor (docs/MEASUREMENTS.md). So :func:`fingerprint_staged` fingerprints many
small tensors with one copy into a staging buffer and one launch (what a weight sync calls, through
:func:`megarlhf.rollout.engines.fingerprint.fingerprint_many`).

Imported only where Triton is importable (CUDA tensors, or ``TRITON_INTERPRET=1`` in tests), because
Triton decides at import time whether kernels are interpreted.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 64


# The two lanes' sums over a block of rows: words [rows, ROW] (uint32), index [rows] (uint32: each row's
# index in its parameter, modulo 2**32).
@triton.jit
def _row_terms(words, index, COLUMNS, ROW_WEIGHTS, ROW: tl.constexpr):
    weights = tl.load(COLUMNS + tl.arange(0, ROW)).to(tl.uint32, bitcast=True)
    sums = tl.sum(words * weights[None, :], axis=1)
    a0 = tl.load(ROW_WEIGHTS).to(tl.uint32, bitcast=True)
    b0 = tl.load(ROW_WEIGHTS + 1).to(tl.uint32, bitcast=True)
    a1 = tl.load(ROW_WEIGHTS + 2).to(tl.uint32, bitcast=True)
    b1 = tl.load(ROW_WEIGHTS + 3).to(tl.uint32, bitcast=True)
    lane0 = tl.sum(sums * ((index * a0 + b0) | 1))
    lane1 = tl.sum(sums * ((index * a1 + b1) | 1))
    return lane0.to(tl.int32, bitcast=True), lane1.to(tl.int32, bitcast=True)


@triton.jit
def _fingerprint_kernel(WORDS, n, start, COLUMNS, ROW_WEIGHTS, OUT, ROW: tl.constexpr,
                        BLOCK_ROWS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = start // ROW + pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    columns = tl.arange(0, ROW)
    local = rows[:, None] * ROW + columns[None, :] - start  # the word's index in this tensor
    ok = (local >= 0) & (local < n)
    words = tl.load(WORDS + local, mask=ok, other=0).to(tl.uint32, bitcast=True)
    lane0, lane1 = _row_terms(words, rows.to(tl.uint32), COLUMNS, ROW_WEIGHTS, ROW)
    tl.atomic_add(OUT, lane0)
    tl.atomic_add(OUT + 1, lane1)


# One block of BLOCK_ROWS staged rows (fingerprint_staged): its first row's index in its parameter is
# FIRST_ROW[pid], its sums go to OUT[SLOT[pid]].
@triton.jit
def _staged_kernel(WORDS, FIRST_ROW, SLOT, COLUMNS, ROW_WEIGHTS, OUT, ROW: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_ROWS).to(tl.int64)
    offsets = (pid * BLOCK_ROWS + rows)[:, None] * ROW + tl.arange(0, ROW)[None, :]
    words = tl.load(WORDS + offsets).to(tl.uint32, bitcast=True)
    index = (tl.load(FIRST_ROW + pid) + rows).to(tl.uint32)
    lane0, lane1 = _row_terms(words, index, COLUMNS, ROW_WEIGHTS, ROW)
    slot = tl.load(SLOT + pid)
    tl.atomic_add(OUT + 2 * slot, lane0)
    tl.atomic_add(OUT + 2 * slot + 1, lane1)


def fingerprint_words(words: torch.Tensor, start: int, columns: torch.Tensor, row_weights: torch.Tensor,
                      row: int) -> torch.Tensor:
    """The fingerprint (int32 [2]) of the int32 ``words`` that sit at word ``start`` of their parameter;
    ``columns`` (int32 [row]) and ``row_weights`` (int32 [4]: a0, b0, a1, b1) on the words' device."""
    out = torch.zeros(2, dtype=torch.int32, device=words.device)
    n = words.numel()
    if n == 0:
        return out
    first_row, last_row = start // row, (start + n - 1) // row
    grid = (triton.cdiv(last_row - first_row + 1, BLOCK_ROWS),)
    _fingerprint_kernel[grid](words, n, start, columns, row_weights, out, ROW=row, BLOCK_ROWS=BLOCK_ROWS)
    return out


def fingerprint_staged(parts: list[tuple[torch.Tensor, int]], columns: torch.Tensor, row_weights: torch.Tensor,
                       row: int) -> torch.Tensor:
    """The fingerprints (int32 [len(parts), 2]) of several tensors' int32 words, each ``(words, start)`` as
    :func:`fingerprint_words` takes them, all on one device, with one copy and one kernel launch.

    The words are staged in one buffer (``torch.cat``: one copy), each tensor's from the column its first
    word has in its parameter (zero words before it) and padded with zero words to whole blocks of
    ``BLOCK_ROWS`` rows; zero words add nothing to a fingerprint. A table gives each block its first row's
    index in its parameter and the tensor it belongs to."""
    device = parts[0][0].device
    out = torch.zeros(len(parts), 2, dtype=torch.int32, device=device)
    block = BLOCK_ROWS * row
    zeros = torch.zeros(block, dtype=torch.int32, device=device)
    pieces, first_rows, slots = [], [], []
    for slot, (words, start) in enumerate(parts):
        if words.numel() == 0:
            continue
        lead = start % row
        blocks = -(-(lead + words.numel()) // block)
        pieces += [zeros[:lead], words, zeros[:blocks * block - lead - words.numel()]]
        first_rows += [start // row + b * BLOCK_ROWS for b in range(blocks)]
        slots += [slot] * blocks
    if not pieces:
        return out
    staged = torch.cat(pieces)
    # pinned and non-blocking: the table's copy to the device does not wait for the work queued there
    table = torch.tensor([first_rows, slots], dtype=torch.int64)  # host: copied below
    table = (table.pin_memory() if device.type == "cuda" else table).to(device, non_blocking=True)
    _staged_kernel[(len(slots),)](staged, table[0], table[1], columns, row_weights, out, ROW=row,
                                  BLOCK_ROWS=BLOCK_ROWS)
    return out
