"""Bitwise fingerprints of weight tensors, computed with tensor ops on the tensor's own device.

The weight sync (:mod:`megarlhf.rollout.sync.weights`) compares what the trainer sent with the parameters
the engine computes with, bit for bit, without a host copy of the model. A fingerprint is two integers
modulo ``2**32`` over the tensor's raw bytes:

* the bytes of a flat parameter are read as little-endian 32-bit *words* (two bf16 elements, one fp32
  element, half an fp64 element), so every dtype is covered, no value is converted, and a 16-bit tensor
  costs half the arithmetic of an fp32 one;
* words are laid out in rows of 64 at their position in the parameter; each word is multiplied by an odd
  weight of its column, a row's products are summed, and each row sum is multiplied by an odd weight of
  the row's index; the rows' terms are summed. Two lanes of the result use different row weights.

All arithmetic is modulo ``2**32`` (int32 tensors that wrap), so it is exact and independent of the
order of summation: no tolerance, the same number on any device. Odd weights are units modulo ``2**32``,
so a change of any one word (one ulp, one bit) always changes both lanes of the fingerprint; any other
change escapes with probability about ``2**-64``. Because a row's index is part of the hash, rows swapped
or shifted are caught; because the terms are additive, the fingerprint of a parameter that an engine
stores fused (vLLM's ``qkv_proj`` = ``[q; k; v]``) is the sum of its parts' fingerprints taken at their
element offsets (:func:`fingerprint` ``offset=``), so the trainer can predict it from the HF tensors it
sends. A part that starts or ends inside a word fills only its own bytes of that word (zeros elsewhere):
the two parts' words add up to the parameter's word, since their bytes do not overlap. Zero words add
nothing: zero padding at the end of a parameter (vLLM pads vocabularies) does not change it.

Two implementations give the same bits: tensor ops (two passes over the tensor in int32, a product
and a row sum, in chunks of ``CHUNK_LANES``: a bounded temporary), and on CUDA one Triton kernel per
tensor (:mod:`megarlhf.rollout.engines.fingerprint_kernel`: on a GPU the tensor ops' time is their launches).
:func:`fingerprint_many` fingerprints a list of tensors; on the Triton path it copies the small ones into
one buffer and hashes them with one launch. Neither path synchronises with the host: callers stack the
results and read them once. A tensor is read in place unless it starts or ends inside a word or sits at
an address that is not a multiple of 4 bytes (then its bytes are copied once, padded).
"""
from __future__ import annotations

import functools
import importlib.util

import torch

MODULUS = 2**32
ROW = 64
CHUNK_LANES = 1 << 20  # words per pass: a 4 MiB int32 temporary
STAGING_BYTES = 64 * 2**20  # the most fingerprint_many copies at once to fingerprint it in one launch
# odd column weights (fixed: trainer and engine must use the same), and the two lanes' row weights:
# row r is weighted ((r * a + b) mod 2**32) | 1
_COLUMN_WEIGHTS = [(2 * ((k * 2654435761) % 127) + 1) for k in range(ROW)]
_ROW_WEIGHTS = ((0x9E3779B1, 0x7F4A7C15), (0x85EBCA6B, 0xC2B2AE35))


def _words(tensor: torch.Tensor, offset: int) -> tuple[torch.Tensor, int]:
    """The bytes of ``tensor`` as the int32 words of a flat parameter that holds it at element ``offset``,
    and the index of the first of them (module docstring: a word it fills only partly is padded with zero
    bytes)."""
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
    first_byte = offset * tensor.element_size()
    head, tail = first_byte % 4, -(first_byte + raw.numel()) % 4
    if head or tail:
        raw = torch.cat([raw.new_zeros(head), raw, raw.new_zeros(tail)])
    elif raw.storage_offset() % 4:  # a view into its storage at an address int32 cannot alias
        raw = raw.clone()
    return raw.view(torch.int32), first_byte // 4


def _as_int32(values: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as the int32 with the same low 32 bits (exact, no overflow)."""
    return (values - ((values >> 31) << 32)).to(torch.int32)


class _Accumulator:
    """Sums one tensor's row terms (int32, wrapping: arithmetic modulo 2**32) on its device."""

    def __init__(self, device: torch.device):
        self.columns, self.row_weights = _constants(device)  # int32 [ROW]; int64 [2, (a, b)]
        self.total = torch.zeros(2, dtype=torch.int32, device=device)

    def add_rows(self, rows: torch.Tensor, first_row: int, first_column: int = 0) -> None:
        """``rows`` [R, W] of words at rows ``first_row..`` and columns ``first_column..first_column+W``."""
        width = rows.shape[1]
        sums = (rows * self.columns[first_column:first_column + width]).sum(dim=1, dtype=torch.int32)
        index = torch.arange(first_row, first_row + rows.shape[0], dtype=torch.int64, device=rows.device)
        weights = _as_int32(((index[:, None] * self.row_weights[:, 0] + self.row_weights[:, 1]) % MODULUS) | 1)
        self.total += (sums[:, None] * weights).sum(dim=0, dtype=torch.int32)

    def result(self) -> torch.Tensor:
        return self.total


def fingerprint(tensor: torch.Tensor, offset: int = 0, backend: str = "auto") -> torch.Tensor:
    """The fingerprint (int32 [2], on ``tensor.device``; read it with :func:`to_host`) of ``tensor`` placed
    at element ``offset`` of a flat parameter of its dtype (0: the tensor is the whole parameter).
    ``backend``: "torch" (tensor ops, any device), "triton" (one kernel per tensor:
    :mod:`megarlhf.rollout.engines.fingerprint_kernel`; CUDA, or Triton's interpreter) or "auto" (Triton for CUDA
    tensors where it is importable). Both give the same bits."""
    _check_backend(backend)
    words, start = _words(tensor, offset)
    if _on_triton(words, backend):
        from megarlhf.rollout.engines.fingerprint_kernel import fingerprint_words

        return fingerprint_words(words, start, _constants(words.device)[0], _kernel_row_weights(words.device), ROW)
    acc = _Accumulator(words.device)
    n, done = words.numel(), 0
    head = min((-start) % ROW, n)
    if head:  # words before the first row boundary
        acc.add_rows(words[:head].view(1, head), start // ROW, start % ROW)
        done = head
    full = (n - done) // ROW * ROW
    while full > 0:
        take = min(full, CHUNK_LANES)
        acc.add_rows(words[done:done + take].view(-1, ROW), (start + done) // ROW)
        done, full = done + take, full - take
    if done < n:  # the last, partial row
        acc.add_rows(words[done:].view(1, n - done), (start + done) // ROW)
    return acc.result()


def fingerprint_many(pairs: list[tuple[torch.Tensor, int]], backend: str = "auto") -> list[torch.Tensor]:
    """The fingerprints of several ``(tensor, offset)`` pairs, each equal to :func:`fingerprint` of it.

    On the Triton path a model's hundreds of tensors cost launches, not bytes (module docstring), so
    tensors of one device are fingerprinted together: staged (copied once) into a buffer of at most
    ``STAGING_BYTES`` and hashed by one kernel launch per buffer
    (:func:`~megarlhf.rollout.engines.fingerprint_kernel.fingerprint_staged`). A tensor of more than half that size
    needs no batching and is fingerprinted alone, in place. On the torch path: one :func:`fingerprint`
    per tensor."""
    _check_backend(backend)
    prints: list[torch.Tensor | None] = [None] * len(pairs)
    batch: list[int] = []
    size = 0

    def flush():
        from megarlhf.rollout.engines.fingerprint_kernel import fingerprint_staged

        words = [_words(*pairs[i]) for i in batch]
        device = words[0][0].device
        staged = fingerprint_staged(words, _constants(device)[0], _kernel_row_weights(device), ROW)
        for slot, i in enumerate(batch):
            prints[i] = staged[slot]

    for i, (tensor, offset) in enumerate(pairs):
        nbytes = tensor.numel() * tensor.element_size()
        if not _on_triton(tensor, backend) or nbytes > STAGING_BYTES // 2:
            prints[i] = fingerprint(tensor, offset, backend)
            continue
        if batch and (size + nbytes > STAGING_BYTES or pairs[batch[0]][0].device != tensor.device):
            flush()
            batch, size = [], 0
        batch.append(i)
        size += nbytes
    if batch:
        flush()
    return prints


def _check_backend(backend: str) -> None:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"fingerprint: backend must be 'auto', 'torch' or 'triton', got {backend!r}")


def _on_triton(tensor: torch.Tensor, backend: str) -> bool:
    return backend == "triton" or (backend == "auto" and tensor.is_cuda and _triton_importable())


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The column weights (int32 [ROW]) and the row weights' constants (int64 [2, (a, b)]) on ``device``,
    made once per device rather than copied there for every tensor."""
    return (torch.tensor(_COLUMN_WEIGHTS, dtype=torch.int32, device=device),
            torch.tensor(_ROW_WEIGHTS, dtype=torch.int64, device=device))


@functools.cache
def _kernel_row_weights(device: torch.device) -> torch.Tensor:
    """The row weights' constants as the Triton kernel reads them: int32 [a0, b0, a1, b1]."""
    return _as_int32(_constants(device)[1]).view(-1)


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
