"""Which tokens each context-parallel rank holds, and how to put per-token results back in order.

Context parallelism (CP) splits the sequence dimension over the ``cp`` ranks of a CP group. The split
is Megatron's load-balanced one: every sequence of (padded) length ``L`` is cut into ``2 * cp`` equal
chunks and CP rank ``r`` holds chunk ``r`` followed by chunk ``2 * cp - 1 - r`` (a head and a tail),
so that every rank does the same amount of causal-attention work. Megatron's rotary embedding assumes
exactly this order (``get_pos_emb_on_this_cp_rank`` for one sequence per row, and
``_apply_rotary_pos_emb_thd`` for packed sequences, whose ``cu_seqlens`` are the *global* padded
boundaries), so the tokens this module hands a rank get the right rotary positions from an unchanged
``GPTModel``.

Packed micro-batches (several sequences in one row, ``qkv_format="thd"``) are split one sequence at a
time. A sequence whose length is not a multiple of ``2 * cp`` is padded at its end to the next
multiple; padding tokens sit after every real token of their sequence, so the causal mask keeps them
out of every real token's attention, and their loss mask is 0.

Megatron's own per-document split (``megatron.core.utils.get_batch_on_this_cp_rank``)
calls Transformer Engine's ``thd_get_partitioned_indices``, which does not exist on CPU, and neither it
nor Megatron offers the inverse (CP-sharded per-token outputs back to the original order), which the
RL losses and the scoring step need.

Devices: a plan is computed on the host from the sequence lengths (a few integers) and moved to the
model's device once (:meth:`CPShardPlan.to`); every tensor the functions here create follows the
device of the plan or of their input.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor


@dataclass(frozen=True)
class CPShardPlan:
    """The token assignment of one CP rank for one (packed) micro-batch row.

    ``cu_seqlens`` are the real sequence boundaries in the unpadded packed row, ``cu_seqlens_padded``
    the boundaries after padding each sequence to a multiple of ``2 * cp_size``. ``local_index[i]``
    is the index, in the padded packed row, of this rank's i-th local token. ``bounds`` and
    ``padded_bounds`` are the same boundaries as host integers: sizes are read from them, never from the
    device tensors (which would synchronise the device).
    """

    cp_size: int
    cp_rank: int
    cu_seqlens: Tensor
    cu_seqlens_padded: Tensor
    local_index: Tensor
    bounds: tuple[int, ...]
    padded_bounds: tuple[int, ...]

    @property
    def total_tokens(self) -> int:
        return self.bounds[-1]

    @property
    def padded_tokens(self) -> int:
        return self.padded_bounds[-1]

    @property
    def local_tokens(self) -> int:
        return self.local_index.numel()

    @property
    def max_seqlen_padded(self) -> int:
        return max(hi - lo for lo, hi in zip(self.padded_bounds[:-1], self.padded_bounds[1:]))

    def padded_position_of_original(self) -> Tensor:
        """int64 [total_tokens]: where each original token sits in the padded packed row."""
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        shift = (self.cu_seqlens_padded[:-1] - self.cu_seqlens[:-1]).long()
        return (torch.arange(self.total_tokens, device=self.cu_seqlens.device)
                + torch.repeat_interleave(shift, lengths, output_size=self.total_tokens))

    def local_sequence_start(self) -> Tensor:
        """int64 [local_tokens]: padded-row index where each local token's sequence starts."""
        seq = torch.searchsorted(self.cu_seqlens_padded.long(), self.local_index, right=True) - 1
        return self.cu_seqlens_padded.long()[seq]

    def local_position_ids(self) -> Tensor:
        """int64 [local_tokens]: each local token's position inside its own sequence (0-based)."""
        return self.local_index - self.local_sequence_start()

    def local_is_padding(self) -> Tensor:
        """bool [local_tokens]: True for the padding tokens this rank holds."""
        seq = torch.searchsorted(self.cu_seqlens_padded.long(), self.local_index, right=True) - 1
        real_length = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()[seq]
        return self.local_position_ids() >= real_length

    def for_rank(self, rank: int) -> "CPShardPlan":
        """The same split seen from another rank of the CP group (no communication)."""
        index = _rank_token_index(self.padded_bounds, self.cp_size, rank, self.local_index.device)
        return dataclasses.replace(self, cp_rank=rank, local_index=index)

    def to(self, device: torch.device) -> "CPShardPlan":
        """The same plan with its index tensors on ``device``."""
        return dataclasses.replace(self, cu_seqlens=self.cu_seqlens.to(device),
                                   cu_seqlens_padded=self.cu_seqlens_padded.to(device),
                                   local_index=self.local_index.to(device))


def rank_token_index(cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """Padded-row indices of CP rank ``cp_rank``'s tokens: per sequence, head chunk then tail chunk
    (on the device of ``cu_seqlens_padded``)."""
    bounds = tuple(cu_seqlens_padded.long().tolist())  # host: the boundaries are a few integers
    return _rank_token_index(bounds, cp_size, cp_rank, cu_seqlens_padded.device)


def _rank_token_index(bounds: tuple[int, ...], cp_size: int, cp_rank: int, device) -> Tensor:
    if cp_size == 1:
        return torch.arange(bounds[-1], device=device)
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = (end - start) // (2 * cp_size)
        head = start + cp_rank * chunk
        tail = start + (2 * cp_size - 1 - cp_rank) * chunk
        pieces.append(torch.arange(head, head + chunk, device=device))
        pieces.append(torch.arange(tail, tail + chunk, device=device))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)


def make_shard_plan(cu_seqlens: Tensor | Sequence[int], cp_size: int, cp_rank: int,
                    allow_padding: bool = True) -> CPShardPlan:
    """Plans this rank's share of a packed row with real boundaries ``cu_seqlens`` (``[0, ..., T]``).

    With ``allow_padding=False`` every sequence length must already be a multiple of ``2 * cp_size``
    (the case of Megatron's unpacked ``[batch, seq]`` input, which is never padded here). The plan is
    made on the host from the boundaries (give them as integers to avoid a device read; move the plan
    with :meth:`CPShardPlan.to`).
    """
    if isinstance(cu_seqlens, Tensor):
        cu_seqlens = cu_seqlens.flatten().tolist()  # host: a few integers
    bounds = tuple(int(x) for x in cu_seqlens)
    validate_cp_lengths(bounds, cp_size, allow_padding=allow_padding)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside the context-parallel group of size {cp_size}")
    multiple = 2 * cp_size if cp_size > 1 else 1
    padded = [0]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        padded.append(padded[-1] + -(-(hi - lo) // multiple) * multiple)
    host = "cpu"  # the plan is made on the host and moved once (.to)
    index = _rank_token_index(tuple(padded), cp_size, cp_rank, host)
    return CPShardPlan(cp_size, cp_rank, torch.tensor(bounds, dtype=torch.int32, device=host),
                       torch.tensor(padded, dtype=torch.int32, device=host), index, bounds, tuple(padded))


def validate_cp_lengths(cu_seqlens: Sequence[int], cp_size: int, allow_padding: bool = True) -> None:
    """Raises a ValueError that explains which sequence breaks which context-parallel constraint."""
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"context_parallel_size must be a positive integer, got {cp_size!r}")
    cu_seqlens = list(cu_seqlens)
    if len(cu_seqlens) < 2 or cu_seqlens[0] != 0:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [0, end_1, ..., end_n] with at least one "
                         f"sequence, got {cu_seqlens}")
    lengths = [hi - lo for lo, hi in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    for i, length in enumerate(lengths):
        if length <= 0:
            raise ValueError(f"sequence {i} of the packed batch has length {length}: cu_seqlens must "
                             f"be strictly increasing, got {cu_seqlens}")
        if cp_size > 1 and not allow_padding and length % (2 * cp_size):
            raise ValueError(
                f"sequence {i} has length {length}, which is not divisible by 2 * "
                f"context_parallel_size = {2 * cp_size}: the load-balanced CP split cuts every sequence "
                f"into 2 * cp equal chunks. Pad it to {-(-length // (2 * cp_size)) * 2 * cp_size} tokens "
                f"or pack the batch (packed sequences are padded one by one)")


class _GatherAlongDim(torch.autograd.Function):
    """All-gather along ``dim``. Backward, ``reduce_grads=True``: a reduce-scatter (each rank gets the
    sum over ranks of the gradient of its slice: right when each rank's use of the gathered tensor is
    its own, like K/V in CP attention). ``reduce_grads=False``: each rank keeps the gradient of its
    own slice (right when every rank computes the same function of the gathered tensor).
    Not ``torch.distributed.nn.functional.all_gather``: it is deprecated in torch 2.13,
    its replacement lives in a private module, and neither offers the second mode."""

    @staticmethod
    def forward(ctx, tensor: Tensor, dim: int, group, reduce_grads: bool) -> Tensor:
        ctx.dim, ctx.group, ctx.reduce_grads = dim, group, reduce_grads
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        parts = [part.contiguous() for part in grad.chunk(dist.get_world_size(ctx.group), ctx.dim)]
        if not ctx.reduce_grads:
            return parts[dist.get_rank(ctx.group)], None, None, None
        mine = torch.empty_like(parts[0])
        dist.reduce_scatter(mine, parts, group=ctx.group)
        return mine, None, None, None


def all_gather_along(tensor: Tensor, dim: int, group: Optional[dist.ProcessGroup],
                     reduce_grads: bool = True) -> Tensor:
    """Concatenation of every group rank's ``tensor`` along ``dim`` (rank order), autograd-aware."""
    return _GatherAlongDim.apply(tensor, dim, group, reduce_grads)


def shard(plan: CPShardPlan, full: Tensor, pad_value: float | int = 0, seq_dim: int = 0) -> Tensor:
    """This rank's tokens of ``full`` (original packed order along ``seq_dim``), padding filled in."""
    if full.size(seq_dim) != plan.total_tokens:
        raise ValueError(f"tensor has {full.size(seq_dim)} tokens along dim {seq_dim}, but the shard plan "
                         f"was made for {plan.total_tokens} (cu_seqlens {list(plan.bounds)})")
    moved = full.movedim(seq_dim, 0)
    padded = moved.new_full((plan.padded_tokens, *moved.shape[1:]), pad_value)
    padded[plan.padded_position_of_original()] = moved
    return padded.index_select(0, plan.local_index).movedim(0, seq_dim)


def unshard(plan: CPShardPlan, local: Tensor, group: Optional[dist.ProcessGroup] = None,
            seq_dim: int = 0) -> Tensor:
    """The inverse of :func:`shard`: gathers every CP rank's ``local`` and restores original order.

    Padding tokens are dropped. Differentiable for a loss that every CP rank computes identically
    from the result (each rank keeps the gradient of its own tokens; summing parameter gradients over
    the CP group then gives the full gradient). Per-rank losses on local tokens need no unshard.
    """
    if local.size(seq_dim) != plan.local_tokens:
        raise ValueError(f"local tensor has {local.size(seq_dim)} tokens along dim {seq_dim}, the shard "
                         f"plan gives this rank {plan.local_tokens}")
    moved = local.movedim(seq_dim, 0)
    stacked = moved if plan.cp_size == 1 else all_gather_along(moved, 0, group, reduce_grads=False)
    order = torch.cat([plan.for_rank(r).local_index for r in range(plan.cp_size)])
    padded = torch.empty_like(stacked).index_copy(0, order, stacked)
    return padded.index_select(0, plan.padded_position_of_original()).movedim(0, seq_dim)


@dataclass
class HostBoundsSeqParams(PackedSeqParams):
    """Megatron's ``PackedSeqParams`` (``thd``) plus what the model would otherwise read back from the
    device in every layer: ``padded_bounds`` (``cu_seqlens_q_padded`` as host integers, for attention) and,
    at context parallel size 1, ``token_positions`` (each packed token's logical position, so the rotary
    table is indexed once per micro-batch: :class:`model_providers.gpt_model.TokenPositionGPTModel`).
    ``attention_cache`` holds what attention builds once per micro-batch for all its layers (FlexAttention's
    block mask, :mod:`parallel.flex_packed_attention`); it lives as long as the micro-batch's params."""

    padded_bounds: tuple[int, ...] = ()
    token_positions: Tensor | None = None
    attention_cache: dict = field(default_factory=dict, repr=False, compare=False)


def packed_seq_params_for(plan: CPShardPlan, group: Optional[dist.ProcessGroup] = None,
                          token_positions: Tensor | None = None) -> HostBoundsSeqParams:
    """Megatron ``PackedSeqParams`` (``thd``) describing the whole packed row of ``plan``.

    ``max_seqlen_*`` is the longest padded sequence: Megatron sizes the rotary table with it, and a
    value equal to the padded row length would switch its rotary code to row-offset positions.
    """
    return HostBoundsSeqParams(
        qkv_format="thd",
        cu_seqlens_q=plan.cu_seqlens, cu_seqlens_kv=plan.cu_seqlens,
        cu_seqlens_q_padded=plan.cu_seqlens_padded, cu_seqlens_kv_padded=plan.cu_seqlens_padded,
        max_seqlen_q=plan.max_seqlen_padded, max_seqlen_kv=plan.max_seqlen_padded,
        cp_group=group, padded_bounds=plan.padded_bounds, token_positions=token_positions,
    )
