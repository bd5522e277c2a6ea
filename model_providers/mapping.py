"""The shared kinds of HF <-> Megatron weight mapping, and the table entry that names one mapping.

An architecture file (``llama.py``, ``qwen2.py``, ...) is a table of :class:`WeightMapping` entries:
which Megatron parameter, which HF tensor(s), which kind. A kind knows how one tensor is laid out on
both sides and converts both ways:

* ``load(hf_sources, ctx)``: the HF tensor(s) -> this tensor-parallel rank's Megatron shard. The sources
  only need ``.shape`` and slicing, so a kind reads just the rows/columns its rank owns (safetensors
  ``get_slice`` objects and plain tensors both qualify).
* ``export(shards, ctx)``: the shards of every TP rank, in rank order -> the full HF tensor(s).

The layouts are Megatron-Core's (fused QKV grouped per query group, the per-rank
[gate; up] fc1 block, padded vocab-parallel rows) and no installable library converts them for
Megatron-Core 0.19.2 on Python 3.11 (Megatron-Bridge needs 3.12 and TE; see docs/PLATFORM.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


class TensorSource(Protocol):
    """Anything with a shape that returns a torch tensor when sliced (a tensor, a safetensors slice)."""

    shape: tuple[int, ...]

    def __getitem__(self, index) -> torch.Tensor: ...


@dataclass(frozen=True)
class ShardContext:
    """What a kind needs to know about the model and this rank to lay a tensor out."""

    tp_rank: int
    tp_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int


def _shard_range(length: int, ctx: ShardContext, what: str) -> tuple[int, int]:
    if length % ctx.tp_size:
        raise ValueError(f"{what}: dimension {length} is not divisible by tensor parallel size {ctx.tp_size}")
    per_rank = length // ctx.tp_size
    return ctx.tp_rank * per_rank, (ctx.tp_rank + 1) * per_rank


class Replicated:
    """The same full tensor on every TP rank (norm weights, value heads)."""

    num_hf = 1
    tp_sharded = False

    def load(self, hf: Sequence[TensorSource], ctx: ShardContext) -> torch.Tensor:
        return hf[0][:]

    def export(self, shards: Sequence[torch.Tensor], ctx: ShardContext) -> list[torch.Tensor]:
        return [shards[0]]


class Shared:
    """One replicated tensor that the HF side stores ``num_hf`` times (a LoRA A factor of a fused Megatron
    layer: q, k and v, or gate and up, read the same input through the same A). Loading requires the
    copies to be equal."""

    tp_sharded = False

    def __init__(self, num_hf: int):
        self.num_hf = num_hf

    def load(self, hf: Sequence[TensorSource], ctx: ShardContext) -> torch.Tensor:
        first = hf[0][:]
        if any(not torch.equal(first, h[:]) for h in hf[1:]):
            raise ValueError(f"{self.num_hf} HF tensors that one Megatron tensor stores once differ")
        return first

    def export(self, shards: Sequence[torch.Tensor], ctx: ShardContext) -> list[torch.Tensor]:
        return [shards[0]] * self.num_hf


class ColumnParallel:
    """Split along dim 0 (output features): each TP rank holds a contiguous block of rows."""

    num_hf = 1
    tp_sharded = True

    def load(self, hf: Sequence[TensorSource], ctx: ShardContext) -> torch.Tensor:
        start, end = _shard_range(hf[0].shape[0], ctx, "column-parallel rows")
        return hf[0][start:end]

    def export(self, shards: Sequence[torch.Tensor], ctx: ShardContext) -> list[torch.Tensor]:
        return [torch.cat(list(shards), dim=0)]


class RowParallel:
    """Split along dim 1 (input features): each TP rank holds a contiguous block of columns."""

    num_hf = 1
    tp_sharded = True

    def load(self, hf: Sequence[TensorSource], ctx: ShardContext) -> torch.Tensor:
        start, end = _shard_range(hf[0].shape[1], ctx, "row-parallel columns")
        return hf[0][:, start:end]

    def export(self, shards: Sequence[torch.Tensor], ctx: ShardContext) -> list[torch.Tensor]:
        return [torch.cat(list(shards), dim=1)]


class FusedQKV:
    """HF (q, k, v) projections (weights or biases) <-> Megatron's fused ``linear_qkv``.

    Megatron orders the fused rows per query group: [the group's q heads..., its k head, its v head],
    groups one after another; TP rank r holds groups [r*G/tp, (r+1)*G/tp). A rank's q, k and v rows are
    therefore contiguous blocks of the HF tensors, which is what lets loading read only those rows.
    """

    num_hf = 3
    tp_sharded = True

    def load(self, hf: Sequence[TensorSource], ctx: ShardContext) -> torch.Tensor:
        groups = ctx.num_query_groups // ctx.tp_size
        q_per_group = ctx.num_attention_heads // ctx.num_query_groups
        d = ctx.head_dim
        q_rows = groups * q_per_group * d
        kv_rows = groups * d
        q = hf[0][ctx.tp_rank * q_rows:(ctx.tp_rank + 1) * q_rows]
        k = hf[1][ctx.tp_rank * kv_rows:(ctx.tp_rank + 1) * kv_rows]
        v = hf[2][ctx.tp_rank * kv_rows:(ctx.tp_rank + 1) * kv_rows]
        rest = tuple(q.shape[1:])
        fused = torch.cat([q.reshape(groups, q_per_group * d, *rest), k.reshape(groups, d, *rest),
                           v.reshape(groups, d, *rest)], dim=1)
        return fused.reshape(-1, *rest)

    def export(self, shards: Sequence[torch.Tensor], ctx: ShardContext) -> list[torch.Tensor]:
        q_per_group = ctx.num_attention_heads // ctx.num_query_groups
        d = ctx.head_dim
        full = torch.cat(list(shards), dim=0)
        rest = tuple(full.shape[1:])
        grouped = full.reshape(ctx.num_query_groups, (q_per_group + 2) * d, *rest)
        q, k, v = torch.split(grouped, [q_per_group * d, d, d], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


class GatedMLP:
    """HF (gate_proj, up_proj) <-> Megatron's ``linear_fc1``; TP rank r holds [gate_r; up_r]."""

    num_hf = 2
    tp_sharded = True

    def load(self, hf: Sequence[TensorSource], ctx: ShardContext) -> torch.Tensor:
        start, end = _shard_range(hf[0].shape[0], ctx, "gated MLP rows")
        return torch.cat([hf[0][start:end], hf[1][start:end]], dim=0)

    def export(self, shards: Sequence[torch.Tensor], ctx: ShardContext) -> list[torch.Tensor]:
        halves = [torch.chunk(shard, 2, dim=0) for shard in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]


class VocabParallel:
    """Embedding / LM-head rows split over TP ranks, the vocab padded to ``padded_vocab_size``.

    Padded rows are zero when loading and dropped when exporting.
    """

    num_hf = 1
    tp_sharded = True

    def load(self, hf: Sequence[TensorSource], ctx: ShardContext) -> torch.Tensor:
        start, end = _shard_range(ctx.padded_vocab_size, ctx, "padded vocab")
        real_end = min(end, ctx.vocab_size)
        rows = hf[0][start:real_end] if start < real_end else None
        shape = (end - start, *hf[0].shape[1:])
        if rows is not None and rows.shape[0] == shape[0]:
            return rows
        out = torch.zeros(shape, dtype=rows.dtype if rows is not None else torch.float32)
        if rows is not None:
            out[:rows.shape[0]] = rows
        return out

    def export(self, shards: Sequence[torch.Tensor], ctx: ShardContext) -> list[torch.Tensor]:
        return [torch.cat(list(shards), dim=0)[:ctx.vocab_size].contiguous()]


REPLICATED = Replicated()
COLUMN = ColumnParallel()
ROW = RowParallel()
QKV = FusedQKV()
GATED_MLP = GatedMLP()
VOCAB = VocabParallel()


@dataclass(frozen=True)
class WeightMapping:
    """One Megatron parameter <-> its HF tensor(s) through one kind.

    Names may contain ``{layer}``: the Megatron name takes this stage's local layer index, the HF names
    the global one; and ``{expert}`` (a routed expert of an MoE layer): the Megatron name takes this
    rank's local expert index, the HF names the global one, and the kind's tensor-parallel split is the
    expert tensor-parallel one. ``export=False`` marks a parameter that is loaded but never exported because another
    entry already exports the same HF tensor (the last pipeline stage's copy of a tied embedding).
    """

    megatron: str
    hf: tuple[str, ...]
    kind: Replicated | Shared | ColumnParallel | RowParallel | FusedQKV | GatedMLP | VocabParallel
    export: bool = True

    def __post_init__(self):
        if len(self.hf) != self.kind.num_hf:
            raise ValueError(f"mapping for {self.megatron}: {type(self.kind).__name__} takes "
                             f"{self.kind.num_hf} HF tensors, got {len(self.hf)}")

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.megatron

    @property
    def per_expert(self) -> bool:
        return "{expert}" in self.megatron

    def hf_names(self, layer: int = 0, expert: int = 0) -> tuple[str, ...]:
        return tuple(h.format(layer=layer, expert=expert) for h in self.hf)
