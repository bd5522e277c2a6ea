"""Shared-prefix ("tree") packed sequences: several sequences that begin with the same tokens carry those
tokens once.

A GRPO group's samples, or a preference pair's two sides, repeat one prompt. Packed as a tree, the prompt
is one *prefix segment* and every sample's remaining tokens a *branch segment* that attends to the whole
prefix segment and causally to itself; every token keeps its logical position (a branch continues at the
prefix's length). The prompt's layers are then computed once per tree instead of once per sample, and
autograd sums the branches' gradients into it, so outputs and gradients are those of the separate
sequences.

Two pieces make a Megatron ``GPTModel`` run such a row:

* :class:`SharedPrefixSeqParams`, :class:`parallel.cp_sharding.HostBoundsSeqParams` (Megatron's
  ``PackedSeqParams`` with host boundaries and ``token_positions``, each packed token's logical position)
  plus ``prefix_of`` (for each segment of ``cu_seqlens``, the index of the segment it also sees, or -1).
  The attention that honours ``prefix_of`` (context parallel size 1) is one FlexAttention call per row on
  a GPU (:mod:`parallel.flex_packed_attention`) and :func:`parallel.cp_attention.per_sequence_attention`
  elsewhere;
* :class:`model_providers.gpt_model.TokenPositionGPTModel`, a ``GPTModel`` whose rotary table, for params
  with ``token_positions``, is indexed by them: one row per packed token, which Megatron's unfused ``thd``
  RoPE applies as is (its "packed freqs" case). Megatron's own GPTModel always numbers positions from each segment's start. Plain
  packed rows at CP = 1 carry their positions too, so the table is built once per micro-batch rather than
  sliced per segment in every layer.

Only megarlhf's local attention reads ``prefix_of``: Transformer Engine's attention would ignore it, and
TE's fused RoPE would misread the per-token table, so both are refused here rather than computing
something else (:func:`check_supported`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from parallel.cp_sharding import CPShardPlan, HostBoundsSeqParams

NO_PREFIX = -1


@dataclass
class SharedPrefixSeqParams(HostBoundsSeqParams):
    """``thd`` params of a packed row with shared-prefix segments (see the module docstring)."""

    prefix_of: tuple[int, ...] = ()


def shared_prefix_seq_params(plan: CPShardPlan, prefix_of: tuple[int, ...], token_positions: Tensor,
                             longest: int, cp_group=None) -> SharedPrefixSeqParams:
    """The params of one packed row (context parallel size 1): the segments of ``plan``, ``prefix_of`` per
    segment, the logical position of every packed token, and ``longest``, the rotary table's length (past
    the largest logical position). Sizes come from the plan's host boundaries: nothing is read back."""
    bounds = plan.bounds
    segments = len(bounds) - 1
    if len(prefix_of) != segments:
        raise ValueError(f"shared_prefix_seq_params: {len(prefix_of)} prefix_of entries for {segments} segments")
    if any(p != NO_PREFIX and not 0 <= p < i for i, p in enumerate(prefix_of)):
        raise ValueError(f"shared_prefix_seq_params: a segment's prefix must be an earlier segment, got {prefix_of}")
    if token_positions.numel() != bounds[-1]:
        raise ValueError(f"shared_prefix_seq_params: {token_positions.numel()} positions for "
                         f"{bounds[-1]} packed tokens")
    cu_seqlens = plan.cu_seqlens
    return SharedPrefixSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens, cu_seqlens_kv_padded=cu_seqlens,
        max_seqlen_q=longest, max_seqlen_kv=longest, cp_group=cp_group, padded_bounds=bounds,
        prefix_of=tuple(prefix_of), token_positions=token_positions.long())


def check_supported(config, cp_size: int) -> None:
    """Raises unless a model with ``config`` (a TransformerConfig) can run shared-prefix rows."""
    problems = []
    if cp_size != 1:
        problems.append(f"context_parallel_size={cp_size} (shared prefixes need 1)")
    if getattr(config, "apply_rope_fusion", False):
        problems.append("apply_rope_fusion=True (the fused thd RoPE numbers positions per segment)")
    if problems:
        raise ValueError("shared-prefix packed rows (train.share_prompt_prefix) cannot run on this model: "
                         + "; ".join(problems) + "; set train.share_prompt_prefix=false")


__all__ = ["NO_PREFIX", "SharedPrefixSeqParams", "check_supported", "shared_prefix_seq_params"]
