"""One attention call per shared-prefix micro-batch on a GPU: FlexAttention with a block mask built from
the row's segments (context parallel size 1).

Token ``q`` of segment ``seg[q]`` sees key ``k`` when both are in one segment and ``k <= q`` (causal within
a sequence or branch), or when ``k`` lies in the segment that ``q``'s segment shares as its prompt prefix
(``prefix_of``, :mod:`parallel.shared_prefix`): the whole prefix, in front of the branch's own keys. The
block mask (one entry per 128 x 128 tile, the tiles no token pair needs are skipped) is built once per
micro-batch and reused by every layer; no token x token mask or per-branch copy of the prefix's keys and
values is kept, and the compiled kernel's backward recomputes the scores from its saved log-sum-exp.
The block mask itself is a few int32 tensors of (tokens / 128)^2 entries (~64 KiB at 8192 tokens); it
is built a few hundred query rows at a time, so building it never holds a token x token array.

Why FlexAttention rather than the per-segment loop of :func:`parallel.cp_attention.per_sequence_attention`:
the loop makes one SDPA call per segment per layer, and for a branch also concatenates the prefix's K/V
(kept for backward); on a GPU FlexAttention made sharing the prompt worth it where the loop did not, and
plain packed rows keep the loop (docs/MEASUREMENTS.md). FlexAttention has no backward on CPU and needs
Triton to compile, so CPU keeps the loop for every row (:func:`flex_usable` says which runs).
"""
from __future__ import annotations

import importlib.util
from functools import cache

import torch
from torch import Tensor

from parallel.shared_prefix import NO_PREFIX


def flex_usable(q: Tensor, head_dim: int) -> bool:
    """Whether FlexAttention runs this attention: a CUDA tensor, Triton importable, and a head size the
    compiled kernel takes (a power of two from 16 to 256). Asked in every layer: the lookup is cached."""
    return (q.is_cuda and _triton_importable()
            and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0)


FLEX_RECOMPILE_LIMIT = 64


@cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


@cache
def _compiled_flex():
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    # the packed row's length changes between micro-batches: after the first recompile torch.compile
    # marks it dynamic, so lengths do not compile one kernel each. Each dtype, grad mode and head layout
    # still compiles its own graph, all counted against one code object: past dynamo's default limit of
    # 8 it silently runs flex_attention eagerly, which materialises the whole score matrix (the GPU check
    # hit that after its RL tests: "flex_attention called without torch.compile()")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, FLEX_RECOMPILE_LIMIT)
    return torch.compile(flex_attention)


def block_mask_for(packed_seq_params, bounds: tuple[int, ...], prefix_of: tuple[int, ...] | None,
                   device: torch.device):
    """The row's block mask, built by the first layer and kept in the micro-batch's params for the others
    (``attention_cache`` of :class:`parallel.cp_sharding.HostBoundsSeqParams`; params without one get a
    fresh mask per call)."""
    cache = getattr(packed_seq_params, "attention_cache", None)
    if cache is None:
        return segment_block_mask(bounds, prefix_of, device)
    key = ("flex_block_mask", bounds, prefix_of)
    if key not in cache:
        cache[key] = segment_block_mask(bounds, prefix_of, device)
    return cache[key]


BLOCK = 128  # FlexAttention's tile (its default BLOCK_SIZE)
ROWS_PER_PASS = 4 * BLOCK  # query rows whose visibility is evaluated at once (bounds the transient memory)


def segment_block_mask(bounds: tuple[int, ...], prefix_of: tuple[int, ...] | None, device: torch.device):
    """The FlexAttention ``BlockMask`` of a packed row whose segments are ``[bounds[i], bounds[i+1])``.

    Built from the visibility of ``ROWS_PER_PASS`` query rows at a time, reduced to which 128 x 128 tiles
    are partly and which wholly visible (``BlockMask.from_kv_blocks``): the transient is ROWS_PER_PASS x
    tokens booleans (32 MiB at 64k tokens), where ``create_block_mask`` evaluates every token pair at once."""
    from torch.nn.attention.flex_attention import BlockMask

    lengths = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
    total = bounds[-1]
    segments = torch.arange(len(lengths), device=device)
    # one copy to the device per packed row (the first layer builds the mask, the others reuse it)
    host = torch.tensor([lengths, list(prefix_of or (NO_PREFIX,) * len(lengths))])  # host: copied once below
    counts, prefixes = host.to(device)
    seg = torch.repeat_interleave(segments, counts, output_size=total)  # output_size: no device read
    sees = torch.repeat_interleave(prefixes, counts, output_size=total)

    def visible(b, h, q_idx, kv_idx):
        return ((seg[q_idx] == seg[kv_idx]) & (kv_idx <= q_idx)) | (sees[q_idx] == seg[kv_idx])

    blocks = -(-total // BLOCK)
    padded = blocks * BLOCK
    keys = torch.arange(padded, device=device)
    in_range = keys < total
    partial, full = [], []
    for start in range(0, padded, ROWS_PER_PASS):
        rows = torch.arange(start, min(start + ROWS_PER_PASS, padded), device=device)
        rows_in, keys_in = rows[:, None] < total, in_range[None, :]
        seen = visible(None, None, rows.clamp(max=total - 1)[:, None], keys.clamp(max=total - 1)[None, :])
        # as torch's create_block_mask: pairs past the row's end count as hidden, so a tile that holds any
        # is partial at most (the kernel then applies the mask there)
        seen = (seen & rows_in & keys_in).view(-1, BLOCK, blocks, BLOCK)
        tiles, whole = seen.any(3).any(1), seen.all(3).all(1)
        partial.append(tiles & ~whole)
        full.append(whole)
    partial, full = torch.cat(partial), torch.cat(full)

    def as_indices(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[1, 1, q blocks] counts and [1, 1, q blocks, kv blocks] kv block indices, the chosen ones first."""
        order = torch.argsort(chosen.to(torch.int8), dim=1, descending=True, stable=True)
        return chosen.sum(1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]

    kv_num, kv_indices = as_indices(partial)
    full_num, full_indices = as_indices(full)
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=BLOCK,
                                    mask_mod=visible, seq_lengths=(total, total))


def flex_packed_attention(q: Tensor, k: Tensor, v: Tensor, block_mask, scale: float) -> Tensor:
    """Attention of one packed row: ``q`` ``[b, groups, per_group, s, d]``, ``k``/``v`` ``[b, groups, 1, s, d]``
    (the layout of :meth:`parallel.cp_attention.ContextParallelAttention._attend`), the same shape back."""
    b, groups, per_group, s, d = q.shape
    # FORCE_USE_FLEX_ATTENTION: rows under 128 tokens would otherwise get the decoding kernel, which torch
    # 2.11's inductor failed to compile for a dynamic length with grouped-query heads (GPU check, H200)
    out = _compiled_flex()(q.reshape(b, groups * per_group, s, d), k.squeeze(2), v.squeeze(2),
                           block_mask=block_mask, scale=scale, enable_gqa=per_group > 1,
                           kernel_options={"FORCE_USE_FLEX_ATTENTION": True})
    return out.reshape(b, groups, per_group, s, d)
