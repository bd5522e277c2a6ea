"""Context parallelism for Megatron-Core's local layer spec: the one entry point the rest of megarlhf uses.

* :func:`with_cp_attention` swaps Megatron's local ``DotProductAttention`` in a layer spec for
  :class:`parallel.cp_attention.ContextParallelAttention` (when CP > 1 or packed sequences are used).
* The token split and its inverse live in :mod:`parallel.cp_sharding` and are re-exported here;
  :mod:`megarlhf.learner.packing` uses them to build each CP rank's micro-batches::

    plan = make_shard_plan(cu_seqlens, cp, cp_rank).to(device)
    tokens = shard(plan, packed_row).unsqueeze(0)
    out = model(tokens, plan.local_position_ids().unsqueeze(0), None,
                packed_seq_params=packed_seq_params_for(plan, cp_group))
    per_token = unshard(plan, local_outputs[0], cp_group)   # every CP rank: original token order
"""
from __future__ import annotations

import copy
from functools import partial

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from parallel.cp_attention import CP_COMM_TYPES, DEFAULT_CP_COMM_TYPE, ContextParallelAttention
from parallel.cp_sharding import (CPShardPlan, make_shard_plan, packed_seq_params_for, rank_token_index, shard,
                                  unshard)
from parallel.spec_tree import replace_in_spec

__all__ = [
    "CPShardPlan", "ContextParallelAttention", "make_shard_plan", "packed_seq_params_for", "rank_token_index",
    "shard", "unshard", "with_cp_attention", "CP_COMM_TYPES", "DEFAULT_CP_COMM_TYPE",
]


def with_cp_attention(spec: ModuleSpec, context_parallel_size: int, packed: bool = False,
                      block_size: int = 256) -> ModuleSpec:
    """``spec`` (a local layer or block spec) with its core attention made context-parallel.

    Returned unchanged (a copy) when ``context_parallel_size == 1`` and ``packed`` is False, where
    Megatron's own attention is enough. Raises if the spec has no local ``DotProductAttention`` to
    replace (e.g. a Transformer Engine spec, which has its own CP). The K/V exchange is Megatron's own
    knob, ``TransformerConfig.cp_comm_type`` (``None`` -> ``"all_gather"``, or ``"p2p"`` for the ring);
    ``block_size`` is the query/key tile of the attention.
    """
    spec = copy.deepcopy(spec)
    if context_parallel_size == 1 and not packed:
        return spec
    replacement = partial(ContextParallelAttention, block_size=block_size)
    swapped, count = replace_in_spec(
        spec, lambda field, value: replacement if field == "core_attention" and value is DotProductAttention else None)
    if count == 0:
        raise ValueError("with_cp_attention: the layer spec has no local DotProductAttention to replace "
                         "(context parallelism with the local spec needs parallel.cp_attention; a "
                         "Transformer Engine spec brings its own)")
    return swapped
