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
* :class:`TokenPositionGPTModel`, a ``GPTModel`` whose rotary table, for params with ``token_positions``,
  is indexed by them: one row per packed token, which Megatron's unfused ``thd`` RoPE applies as is (its
  "packed freqs" case). Megatron's own GPTModel always numbers positions from each segment's start. Plain
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

from megatron.core.models.gpt import GPTModel

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


def shared_prefix_supported() -> bool:
    """Whether the models built here can run shared-prefix rows: megarlhf's local attention is used
    (Transformer Engine's spec is chosen where TE works, and TE does not read ``prefix_of``)."""
    from model_providers.base import uses_transformer_engine

    return not uses_transformer_engine()


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


class TokenPositionGPTModel(GPTModel):
    """``GPTModel`` whose RoPE follows ``token_positions`` for :class:`SharedPrefixSeqParams` rows; any other
    input runs exactly as in ``GPTModel``."""

    def _preprocess(self, *args, packed_seq_params=None, **kwargs):
        out = super()._preprocess(*args, packed_seq_params=packed_seq_params, **kwargs)
        positions = getattr(packed_seq_params, "token_positions", None)
        rotary = out[1]
        if positions is None or rotary is None:
            return out
        if any(p != NO_PREFIX for p in getattr(packed_seq_params, "prefix_of", ())):
            check_supported(self.config, packed_seq_params.cp_group.size() if packed_seq_params.cp_group else 1)
        elif self.config.apply_rope_fusion:
            return out  # plain packed rows: the fused thd RoPE reads cu_seqlens on the device itself
        # [max_len, 1, 1, dim] table -> one row per packed token (Megatron's per-token "packed freqs"), once
        # per micro-batch instead of per segment in every layer
        return (out[0], rotary.index_select(0, positions.to(rotary.device)), *out[2:])


__all__ = ["NO_PREFIX", "SharedPrefixSeqParams", "TokenPositionGPTModel", "check_supported",
           "shared_prefix_seq_params", "shared_prefix_supported"]
