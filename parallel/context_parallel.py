"""Context parallelism for Megatron-Core's local layer spec: the one entry point the rest of megarlhf uses.

* :func:`with_cp_attention` swaps Megatron's local ``DotProductAttention`` in a layer spec for
  :class:`parallel.cp_attention.ContextParallelAttention` (when CP > 1 or packed sequences are used).
* :func:`validate_context_parallel` explains, before anything runs, why a CP layout cannot work.
* The token split, its inverse and the CP x DP token mean live in :mod:`parallel.cp_sharding` and
  are re-exported here.

Typical use on each rank (cp from ``parallel_state``)::

    spec = with_cp_attention(get_gpt_layer_local_spec(normalization="RMSNorm"), cp, packed=True)
    model = GPTModel(config, spec, vocab, max_len, position_embedding_type="rope")
    batch = shard_packed_batch(tokens, cu_seqlens, cp, cp_rank, labels=labels, loss_mask=mask,
                               group=cp_group)
    logits = model(batch.tokens, batch.position_ids, None, packed_seq_params=batch.packed_seq_params)
    logprobs_full = unshard(batch.plan, local_logprobs[0], cp_group)      # original token order
    loss = global_token_mean(per_token_loss, batch.loss_mask, dp_cp_group)  # then sum grads over dp_cp
"""
from __future__ import annotations

import copy
import dataclasses
from functools import partial
from typing import Any, Optional, Sequence

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from parallel.cp_attention import CP_COMM_TYPES, DEFAULT_CP_COMM_TYPE, ContextParallelAttention
from parallel.cp_sharding import (CPShardPlan, ShardedBatch, global_token_mean, make_shard_plan,
                                  packed_seq_params_for, rank_token_index, shard, shard_packed_batch,
                                  unshard, validate_cp_lengths)

__all__ = [
    "CPShardPlan", "ContextParallelAttention", "ShardedBatch", "global_token_mean", "make_shard_plan",
    "packed_seq_params_for", "rank_token_index", "shard", "shard_packed_batch", "unshard",
    "validate_context_parallel", "with_cp_attention", "CP_COMM_TYPES", "DEFAULT_CP_COMM_TYPE",
]


def _swap(node: Any, replacement: Any) -> tuple[Any, int]:
    """Copy of a spec tree with every ``core_attention=DotProductAttention`` replaced; and the count."""
    if isinstance(node, (list, tuple)):
        swapped = [_swap(item, replacement) for item in node]
        return type(node)(item for item, _ in swapped), sum(n for _, n in swapped)
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return node, 0
    changes, count = {}, 0
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if field.name == "core_attention" and value is DotProductAttention:
            changes[field.name], count = replacement, count + 1
        else:
            new_value, n = _swap(value, replacement)
            if n:
                changes[field.name], count = new_value, count + n
    return (dataclasses.replace(node, **changes) if changes else node), count


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
    swapped, count = _swap(spec, replacement)
    if count == 0:
        raise ValueError("with_cp_attention: the layer spec has no local DotProductAttention to replace "
                         "(context parallelism with the local spec needs parallel.cp_attention; a "
                         "Transformer Engine spec brings its own)")
    return swapped


def validate_context_parallel(context_parallel_size: int, sequence_lengths: Sequence[int] = (),
                              packed: bool = False, sequence_parallel: bool = False,
                              uses_local_spec: bool = True, spec_has_cp_attention: bool = True,
                              on_cpu: Optional[bool] = None) -> None:
    """Raises a ValueError naming the violated constraint of a CP layout; returns None if it can run.

    ``sequence_lengths``: the lengths of the sequences of one micro-batch (one per row when not
    packed, the packed sequences otherwise). Unpacked rows are not padded by the CP split, so their
    length must be a multiple of ``2 * cp``; packed sequences are padded one by one.
    """
    import torch

    cp = context_parallel_size
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"context_parallel_size must be a positive integer, got {cp!r}")
    if on_cpu is None:
        on_cpu = not torch.cuda.is_available()
    if sequence_parallel and on_cpu:
        raise ValueError("sequence_parallel is not supported on CPU: Megatron's local spec uses torch "
                         "LayerNorm, which cannot run sequence-parallel; set sequence_parallel=False")
    if cp > 1 and uses_local_spec and not spec_has_cp_attention:
        raise ValueError(f"context_parallel_size={cp} with Megatron's local layer spec needs megarlhf's "
                         f"CP attention: build the spec with parallel.context_parallel.with_cp_attention "
                         f"(Megatron's DotProductAttention refuses CP)")
    if packed and uses_local_spec and not spec_has_cp_attention:
        raise ValueError("packed sequences with Megatron's local layer spec need megarlhf's CP attention "
                         "(with_cp_attention(spec, cp, packed=True)); DotProductAttention refuses them")
    if sequence_lengths:
        bounds = [0]
        for length in sequence_lengths:
            bounds.append(bounds[-1] + int(length))
        validate_cp_lengths(torch.tensor(bounds), cp, allow_padding=packed)
