"""The ``GPTModel`` every provider builds: Megatron's, with RoPE at each packed token's logical position.

Shared-prefix packed rows (:mod:`parallel.shared_prefix`) number a branch's tokens from the end of the
prompt they share, not from the start of their own segment; Megatron's ``GPTModel`` always numbers from the
segment's start. :class:`TokenPositionGPTModel` reads ``token_positions`` from the packed-sequence params
and indexes the rotary table by them; any other input runs exactly as in ``GPTModel``.
"""
from __future__ import annotations

import logging

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt import gpt_model as _megatron_gpt_model

from parallel.shared_prefix import NO_PREFIX, check_supported

DEPRECATION_BANNER = "GPTModel IS DEPRECATED"


class _DropDeprecationBanner(logging.Filter):
    """Megatron-Core 0.19 logs :data:`DEPRECATION_BANNER` at every ``GPTModel`` construction (actor, critic,
    reference, each rebuild). It names no problem of ours: what the deprecation means for megarlhf is in
    docs/ARCHITECTURE.md (Model providers). Only that message is dropped; the logger's others pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return DEPRECATION_BANNER not in record.getMessage()


_megatron_gpt_model.logger.addFilter(_DropDeprecationBanner())


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
