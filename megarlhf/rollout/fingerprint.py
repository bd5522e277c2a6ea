"""Bitwise fingerprints of weight tensors, computed with tensor ops on the tensor's own device.

The weight sync (:mod:`megarlhf.rollout.weight_sync`) compares what the trainer sent with the parameters
the engine computes with, bit for bit, without a host copy of the model. A fingerprint is two integers
in ``[0, P)`` (``P = 2**31 - 1``) over the tensor's raw bits:

* the bits are read as integer *lanes* of the element's width (int8, int16 or int32; an 8-byte element
  is two int32 lanes), so every dtype is covered and no value is converted;
* lanes are laid out in rows of 64 at their position in a flat parameter; each row's sum (in int64) of
  ``lane * c[column]`` (``c`` odd, the product in the lane's width: a bijection even where it wraps, so
  a change of any lane changes the row's sum) is taken mod ``P`` and multiplied by a per-row weight that
  depends on the row's index, mod ``P``; the rows' terms are summed mod ``P``, in two lanes with
  different row weights.

Integer arithmetic makes it exact and independent of summation order (no tolerance, the same number on
any device). Because a row's position is part of the hash, rows swapped or shifted are caught; because
the terms are additive, the fingerprint of a parameter that an engine stores fused (vLLM's ``qkv_proj``
= ``[q; k; v]``) is the sum of its parts' fingerprints taken at their element offsets
(:func:`fingerprint` ``offset=``), so the trainer can predict it from the HF tensors it sends. Zero
lanes add nothing: zero padding at the end of a parameter (vLLM pads vocabularies) does not change it.

A change of one lane (one ulp) always changes the fingerprint; any other change escapes both lanes with
probability about 2**-62. The work is a few passes over the tensor in chunks of ``CHUNK_LANES`` (a
bounded temporary), one small reduction per chunk, and no host synchronisation: callers stack the
results and read them once.
"""
from __future__ import annotations

import torch

PRIME = 2**31 - 1
ROW = 64
CHUNK_LANES = 1 << 20  # lanes per pass: a 4 MiB int32 temporary
# odd column weights below 2**8 (fixed: trainer and engine must use the same), and the two lanes' row
# weight multipliers (row r is weighted (r + 1) * m mod P, never 0 for r + 1 < P)
_COLUMN_WEIGHTS = [(2 * ((k * 2654435761) % 127) + 1) for k in range(ROW)]
_ROW_MULTIPLIERS = (1_103_515_245 % PRIME, 2_147_483_587 % PRIME)
_LANE_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def lanes_per_element(dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    return max(1, size // 4)


def _lanes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a flat integer view (no copy for a contiguous tensor)."""
    flat = tensor.detach().contiguous().view(-1)
    size = flat.element_size()
    return flat.view(_LANE_DTYPES[min(size, 4)])


class _Accumulator:
    """Sums row terms for one tensor on its device."""

    def __init__(self, lane_dtype: torch.dtype, device: torch.device):
        # in the lanes' own width: the product wraps there, still a bijection (odd weights)
        self.columns = torch.tensor(_COLUMN_WEIGHTS, dtype=torch.int32, device=device).to(lane_dtype)
        self.multipliers = torch.tensor(_ROW_MULTIPLIERS, dtype=torch.int64, device=device)
        self.total = torch.zeros(2, dtype=torch.int64, device=device)

    def add_rows(self, rows: torch.Tensor, first_row: int, first_column: int = 0) -> None:
        """``rows`` [R, W] of lanes at rows ``first_row..`` and columns ``first_column..first_column+W``."""
        width = rows.shape[1]
        sums = (rows * self.columns[first_column:first_column + width]).sum(dim=1)  # int64
        index = torch.arange(first_row + 1, first_row + 1 + rows.shape[0], dtype=torch.int64, device=rows.device)
        weights = (index[:, None] * self.multipliers) % PRIME
        self.total = (self.total + ((sums.remainder(PRIME)[:, None] * weights) % PRIME).sum(dim=0)) % PRIME

    def result(self) -> torch.Tensor:
        return self.total


def fingerprint(tensor: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """The fingerprint (int64 [2], on ``tensor.device``) of ``tensor`` placed at element ``offset`` of a
    flat parameter of its dtype (0: the tensor is the whole parameter). See the module docstring."""
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
    return torch.stack(parts).sum(dim=0) % PRIME


def to_host(fingerprints: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """Reads a dict of fingerprints to the host in ONE transfer (one synchronisation for the whole model)."""
    if not fingerprints:
        return {}
    names = list(fingerprints)
    values = torch.stack([fingerprints[n] for n in names]).tolist()  # host: the verdict is compared there
    return {n: (int(a), int(b)) for n, (a, b) in zip(names, values)}
