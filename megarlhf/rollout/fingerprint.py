"""Bitwise fingerprints of weight tensors, computed with tensor ops on the tensor's own device.

The weight sync (:mod:`megarlhf.rollout.weight_sync`) compares what the trainer sent with the parameters
the engine computes with, bit for bit, without a host copy of the model. A fingerprint is two integers
modulo ``2**32`` over the tensor's raw bits:

* the bits are read as integer *lanes* of the element's width (int8, int16 or int32; an 8-byte element
  is two int32 lanes), so every dtype is covered and no value is converted;
* lanes are laid out in rows of 64 at their position in a flat parameter; each lane is multiplied by an
  odd weight of its column (in the lane's width), a row's products are summed, and each row sum is
  multiplied by an odd weight of the row's index; the rows' terms are summed. Two lanes of the result
  use different row weights.

All arithmetic is modulo ``2**32`` (int32 tensors that wrap), so it is exact and independent of the
order of summation: no tolerance, the same number on any device. Odd weights are units modulo ``2**32``,
so a change of any one lane (one ulp, one bit) always changes both lanes of the fingerprint; any other
change escapes with probability about ``2**-64``. Because a row's index is part of the hash, rows swapped
or shifted are caught; because the terms are additive, the fingerprint of a parameter that an engine
stores fused (vLLM's ``qkv_proj`` = ``[q; k; v]``) is the sum of its parts' fingerprints taken at their
element offsets (:func:`fingerprint` ``offset=``), so the trainer can predict it from the HF tensors it
sends. Zero lanes add nothing: zero padding at the end of a parameter (vLLM pads vocabularies) does not
change it.

The work is two passes over the tensor in int32 (a product and a row sum, in chunks of ``CHUNK_LANES``:
a bounded temporary) and no host synchronisation: callers stack the results and read them once.
"""
from __future__ import annotations

import torch

MODULUS = 2**32
ROW = 64
CHUNK_LANES = 1 << 20  # lanes per pass: a 4 MiB int32 temporary
# odd column weights (fixed: trainer and engine must use the same), and the two lanes' row weights:
# row r is weighted ((r * a + b) mod 2**32) | 1
_COLUMN_WEIGHTS = [(2 * ((k * 2654435761) % 127) + 1) for k in range(ROW)]
_ROW_WEIGHTS = ((0x9E3779B1, 0x7F4A7C15), (0x85EBCA6B, 0xC2B2AE35))
_LANE_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def lanes_per_element(dtype: torch.dtype) -> int:
    return max(1, dtype.itemsize // 4)


def _lanes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a flat integer view (no copy for a contiguous tensor)."""
    flat = tensor.detach().contiguous().view(-1)
    return flat.view(_LANE_DTYPES[min(flat.element_size(), 4)])


def _as_int32(values: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as the int32 with the same low 32 bits (exact, no overflow)."""
    return (values - ((values >> 31) << 32)).to(torch.int32)


class _Accumulator:
    """Sums one tensor's row terms (int32, wrapping: arithmetic modulo 2**32) on its device."""

    def __init__(self, lane_dtype: torch.dtype, device: torch.device):
        # in the lanes' own width: the product wraps there and, the weights being odd, stays a bijection
        self.columns = _as_int32(torch.tensor(_COLUMN_WEIGHTS, dtype=torch.int64, device=device)).to(lane_dtype)
        self.row_weights = torch.tensor(_ROW_WEIGHTS, dtype=torch.int64, device=device)  # [2, (a, b)]
        self.total = torch.zeros(2, dtype=torch.int32, device=device)

    def add_rows(self, rows: torch.Tensor, first_row: int, first_column: int = 0) -> None:
        """``rows`` [R, W] of lanes at rows ``first_row..`` and columns ``first_column..first_column+W``."""
        width = rows.shape[1]
        sums = (rows * self.columns[first_column:first_column + width]).sum(dim=1, dtype=torch.int32)
        index = torch.arange(first_row, first_row + rows.shape[0], dtype=torch.int64, device=rows.device)
        weights = _as_int32(((index[:, None] * self.row_weights[:, 0] + self.row_weights[:, 1]) % MODULUS) | 1)
        self.total += (sums[:, None] * weights).sum(dim=0, dtype=torch.int32)

    def result(self) -> torch.Tensor:
        return self.total


def fingerprint(tensor: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """The fingerprint (int32 [2], on ``tensor.device``; read it with :func:`to_host`) of ``tensor`` placed
    at element ``offset`` of a flat parameter of its dtype (0: the tensor is the whole parameter)."""
    lanes = _lanes(tensor)
    acc = _Accumulator(lanes.dtype, lanes.device)
    start, n = offset * lanes_per_element(tensor.dtype), lanes.numel()
    done = 0
    head = min((-start) % ROW, n)
    if head:  # lanes before the first row boundary
        acc.add_rows(lanes[:head].view(1, head), start // ROW, start % ROW)
        done = head
    full = (n - done) // ROW * ROW
    while full > 0:
        take = min(full, CHUNK_LANES)
        acc.add_rows(lanes[done:done + take].view(-1, ROW), (start + done) // ROW)
        done, full = done + take, full - take
    if done < n:  # the last, partial row
        acc.add_rows(lanes[done:].view(1, n - done), (start + done) // ROW)
    return acc.result()


def combine(parts: list[torch.Tensor]) -> torch.Tensor:
    """The fingerprint of a parameter from its parts' fingerprints (each taken at its offset)."""
    return torch.stack(parts).sum(dim=0, dtype=torch.int32)


def to_host(fingerprints: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """Reads a dict of fingerprints to the host in ONE transfer (one synchronisation for the whole model),
    as integers in [0, 2**32)."""
    if not fingerprints:
        return {}
    names = list(fingerprints)
    values = torch.stack([fingerprints[n] for n in names]).tolist()  # host: the verdict is compared there
    return {n: (a % MODULUS, b % MODULUS) for n, (a, b) in zip(names, values)}
