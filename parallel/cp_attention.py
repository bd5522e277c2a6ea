"""Context-parallel core attention for Megatron-Core's local (non-Transformer-Engine) layer spec.

Megatron's local ``DotProductAttention`` refuses context parallelism and packed sequences; the one
that supports both (``TEDotProductAttention``) needs Transformer Engine, which does not run on CPU.
:class:`ContextParallelAttention` is a drop-in replacement (same constructor and ``forward``
signature) that

* takes this CP rank's load-balanced tokens (see :mod:`parallel.cp_sharding`) as queries and the
  keys/values of the whole sequence from the CP group, either by one autograd-aware all-gather
  (``cp_comm_type="all_gather"``, the default) or by passing K/V chunks around a ring of
  point-to-point sends overlapped with the attention of the chunk in hand (``"p2p"``);
* builds the causal mask from each token's index in the padded packed row (``k <= q`` and ``k`` not
  before the start of ``q``'s sequence), so the re-ordered head/tail chunks and packed sequences
  (``packed_seq_params.qkv_format == "thd"``) need no materialised mask and never attend across a
  sequence boundary;
* computes attention in query x key tiles with an online softmax (flash-attention style, in plain
  torch), skipping tiles the mask removes entirely, and recomputes the tiles in backward from the
  saved log-sum-exp, so memory stays O(tokens x head_dim) instead of O(tokens^2) at long lengths;
* supports grouped-query attention without repeating K/V (queries are viewed as
  ``[kv_groups, heads_per_group]``).

The default exchange is an all-gather: one collective per K and V per layer instead of
``2 * (cp - 1) + cp`` point-to-point messages, and a plain backward (on CPU the ring bought nothing
measurable over it: docs/MEASUREMENTS.md). The ring (``"p2p"``) is there for
layouts where K/V per rank are large against compute (GPUs, large cp) or the gathered K/V's memory
matters.

At cp=1 packed rows run one SDPA call per sequence (:func:`per_sequence_attention`); rows with shared
prompt prefixes run one FlexAttention call per row on a GPU (:mod:`parallel.flex_packed_attention`).

No library here provides a CPU context-parallel attention with a causal, packed,
load-balanced mask and a memory-bounded backward; torch's SDPA needs a materialised mask for this
pattern, which it saves for backward (O(tokens^2)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from parallel.cp_sharding import all_gather_along, rank_token_index
from parallel.flex_packed_attention import block_mask_for, flex_packed_attention, flex_usable

CP_COMM_TYPES = ("all_gather", "p2p")
DEFAULT_CP_COMM_TYPE = "all_gather"


@dataclass(frozen=True)
class TokenLayout:
    """Where tokens sit in the padded packed row: ``index`` (causal order) and their sequence start."""

    index: Tensor  # int64 [n]
    start: Tensor  # int64 [n]

    @staticmethod
    def of_rank(cu_seqlens_padded: tuple[int, ...], cp_size: int, cp_rank: int) -> "TokenLayout":
        return _layout(cu_seqlens_padded, cp_size, cp_rank)


@lru_cache(maxsize=64)
def _layout(cu_seqlens_padded: tuple[int, ...], cp_size: int, cp_rank: int) -> TokenLayout:
    cu = torch.tensor(cu_seqlens_padded, dtype=torch.int64)  # host: cached index tables; masks move per tile
    index = rank_token_index(cu, cp_size, cp_rank)
    seq = torch.searchsorted(cu, index, right=True) - 1
    return TokenLayout(index, cu[seq])


def _tile_mask(q: TokenLayout, k: TokenLayout, qs: slice, ks: slice) -> Optional[Tensor] | bool:
    """The [bq, bk] visibility of a tile: False if nothing is visible, None if everything is."""
    q_index, q_start, k_index = q.index[qs], q.start[qs], k.index[ks]
    if int(k_index.min()) > int(q_index.max()) or int(k_index.max()) < int(q_start.min()):
        return False
    visible = (k_index[None, :] <= q_index[:, None]) & (k_index[None, :] >= q_start[:, None])
    if bool(visible.all()):
        return None
    if not bool(visible.any()):
        return False
    return visible


def _acc_dtype(x: Tensor) -> torch.dtype:
    """Tiles accumulate in fp32 (fp64 inputs stay fp64, which the exactness tests use)."""
    return torch.promote_types(x.dtype, torch.float32)


def _blocks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


class Tiling(NamedTuple):
    """The tiled kernels' settings: the score scale and the query/key tile size."""

    scale: float
    block: int


def tiled_attention_forward(q: Tensor, k: Tensor, v: Tensor, layouts: tuple[TokenLayout, TokenLayout],
                            tiling: Tiling) -> tuple[Tensor, Tensor]:
    """Masked softmax attention of ``q`` [B,G,R,Sq,D] over ``k``/``v`` [B,G,1,Sk,D], in fp32 tiles.

    Returns ``(out, lse)``: out [B,G,R,Sq,D] (fp32 or wider, zero for rows that see no key) and the row-wise
    log-sum-exp of the scaled, masked scores [B,G,R,Sq] (-inf for rows that see no key). ``layouts``: the
    queries' and the keys' (which token each row is, for the causal mask).
    """
    (q_layout, k_layout), (scale, block) = layouts, tiling
    acc_dtype = _acc_dtype(q)
    out = q.new_zeros(q.shape, dtype=acc_dtype)
    lse = q.new_full(q.shape[:-1], -math.inf, dtype=acc_dtype)
    for qs in _blocks(q.size(-2), block):
        qb = q[..., qs, :].to(acc_dtype)
        row_max = qb.new_full(qb.shape[:-1], -math.inf)
        row_sum = qb.new_zeros(qb.shape[:-1])
        acc = torch.zeros_like(qb)
        for ks in _blocks(k.size(-2), block):
            mask = _tile_mask(q_layout, k_layout, qs, ks)
            if mask is False:
                continue
            scores = torch.matmul(qb, k[..., ks, :].to(acc_dtype).transpose(-1, -2)) * scale
            if mask is not None:
                scores = scores.masked_fill(~mask.to(scores.device), -math.inf)
            new_max = torch.maximum(row_max, scores.amax(-1))
            safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            probs = torch.exp(scores - safe_max[..., None])
            decay = torch.exp(row_max - safe_max)
            row_sum = row_sum * decay + probs.sum(-1)
            acc = acc * decay[..., None] + torch.matmul(probs, v[..., ks, :].to(acc_dtype))
            row_max = new_max
        seen = row_sum > 0
        out[..., qs, :] = torch.where(seen[..., None], acc / row_sum.clamp(min=1e-30)[..., None], 0.0)
        safe_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        lse[..., qs] = torch.where(seen, safe_max + torch.log(row_sum.clamp(min=1e-30)), -math.inf)
    return out, lse


def tiled_attention_backward(q: Tensor, k: Tensor, v: Tensor, lse: Tensor, grad_out: Tensor, delta: Tensor,
                             layouts: tuple[TokenLayout, TokenLayout], tiling: Tiling) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (fp32) of the attention of ``q`` over ``k``/``v``, recomputing probabilities per tile.

    ``lse`` is the log-sum-exp over *all* keys the queries attend to (in a ring, more than ``k``), and
    ``delta = sum(grad_out * out, -1)`` with the final output; both make this chunk's share exact.
    """
    (q_layout, k_layout), (scale, block) = layouts, tiling
    acc_dtype = _acc_dtype(q)
    dq = q.new_zeros(q.shape, dtype=acc_dtype)
    dk = k.new_zeros(k.shape, dtype=acc_dtype)
    dv = v.new_zeros(v.shape, dtype=acc_dtype)
    for qs in _blocks(q.size(-2), block):
        qb, gb = q[..., qs, :].to(acc_dtype), grad_out[..., qs, :].to(acc_dtype)
        lse_b, delta_b = lse[..., qs, None], delta[..., qs, None]
        for ks in _blocks(k.size(-2), block):
            mask = _tile_mask(q_layout, k_layout, qs, ks)
            if mask is False:
                continue
            kb, vb = k[..., ks, :].to(acc_dtype), v[..., ks, :].to(acc_dtype)
            scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale
            if mask is not None:
                scores = scores.masked_fill(~mask.to(scores.device), -math.inf)
            probs = torch.exp(scores - lse_b)
            # Heads of one KV group share K/V: their contributions add up over the R dimension.
            dv[..., ks, :] += torch.matmul(probs.transpose(-1, -2), gb).sum(2, keepdim=True)
            dscores = probs * (torch.matmul(gb, vb.transpose(-1, -2)) - delta_b) * scale
            dq[..., qs, :] += torch.matmul(dscores, kb)
            dk[..., ks, :] += torch.matmul(dscores.transpose(-1, -2), qb).sum(2, keepdim=True)
    return dq, dk, dv


class _LocalTiledAttention(torch.autograd.Function):
    """Tiled attention over K/V already present on this rank (used after the all-gather)."""

    @staticmethod
    def forward(ctx, q, k, v, layouts, tiling):
        out, lse = tiled_attention_forward(q, k, v, layouts, tiling)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layouts, ctx.tiling = layouts, tiling
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        delta = (grad_out.to(out.dtype) * out).sum(-1)
        dq, dk, dv = tiled_attention_backward(q, k, v, lse, grad_out, delta, ctx.layouts, ctx.tiling)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _merge(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Combines two softmax-normalised partial attentions over disjoint key sets."""
    new_lse = torch.logaddexp(lse, part_lse)
    finite = torch.isfinite(new_lse)
    safe = torch.where(finite, new_lse, torch.zeros_like(new_lse))
    w_old = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(lse))
    w_new = torch.where(finite, torch.exp(part_lse - safe), torch.zeros_like(part_lse))
    return out * w_old[..., None] + part_out * w_new[..., None], new_lse


def _ring_exchange(tensor: Tensor, group: dist.ProcessGroup) -> tuple[Tensor, list]:
    """Starts sending ``tensor`` to the next CP rank and receiving the previous rank's into a buffer."""
    size, rank = group.size(), group.rank()
    recv = torch.empty_like(tensor)
    send_to = dist.get_global_rank(group, (rank + 1) % size)
    recv_from = dist.get_global_rank(group, (rank - 1) % size)
    # Even ranks send first and odd ranks receive first, so blocking transports cannot deadlock.
    if rank % 2 == 0:
        works = [dist.isend(tensor, send_to, group=group), dist.irecv(recv, recv_from, group=group)]
    else:
        works = [dist.irecv(recv, recv_from, group=group), dist.isend(tensor, send_to, group=group)]
    return recv, works


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):
    """Ring attention: K/V chunks travel around the CP group; each step's exchange overlaps compute.

    Forward: step s attends to the chunk of rank (r - s) mod cp while that chunk is already being sent
    on. Backward: K/V go around again, with the gradient accumulators for each chunk travelling with
    it; after cp steps the accumulators of a rank's own chunk come home.
    """

    @staticmethod
    def forward(ctx, q, k, v, layouts, tiling, group):
        size, rank = group.size(), group.rank()
        kv = torch.stack([k, v]).contiguous()
        out = lse = None
        for step in range(size):
            if step < size - 1:
                next_kv, works = _ring_exchange(kv, group)
            src = (rank - step) % size
            part_out, part_lse = tiled_attention_forward(q, kv[0], kv[1], (layouts[rank], layouts[src]), tiling)
            out, lse = (part_out, part_lse) if out is None else _merge(out, lse, part_out, part_lse)
            if step < size - 1:
                _wait(works)
                kv = next_kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layouts, ctx.tiling, ctx.group = layouts, tiling, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, layouts = ctx.group, ctx.layouts
        size, rank = group.size(), group.rank()
        delta = (grad_out.to(out.dtype) * out).sum(-1)
        kv = torch.stack([k, v]).contiguous()
        dkv = kv.new_zeros(kv.shape, dtype=_acc_dtype(kv))
        dq = q.new_zeros(q.shape, dtype=_acc_dtype(q))
        for step in range(size):
            if step < size - 1:
                next_kv, kv_works = _ring_exchange(kv, group)
            src = (rank - step) % size
            part_dq, part_dk, part_dv = tiled_attention_backward(
                q, kv[0], kv[1], lse, grad_out, delta, (layouts[rank], layouts[src]), ctx.tiling)
            dq += part_dq
            dkv[0] += part_dk
            dkv[1] += part_dv
            # The accumulators follow their chunk, one hop behind the K/V exchange already in flight.
            dkv, dkv_works = _ring_exchange(dkv, group)
            _wait(dkv_works)
            if step < size - 1:
                _wait(kv_works)
                kv = next_kv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def per_sequence_attention(q: Tensor, k: Tensor, v: Tensor, bounds: tuple[int, ...], scale: float,
                           prefix_of: tuple[int, ...] | None = None) -> Tensor:
    """Causal attention within each ``[bounds[i], bounds[i+1])`` segment of the token axis, without CP:
    one torch SDPA call per segment (its fused CPU/GPU kernels), ``q`` ``[b, groups, per_group, s, d]``
    and ``k``/``v`` ``[b, groups, 1, s, d]`` as in :meth:`ContextParallelAttention._attend`.

    ``prefix_of[i]`` (optional; -1 for none) names an earlier segment that segment i also sees whole, in
    front of its own causal keys: a shared-prefix branch (:mod:`parallel.shared_prefix`).

    Used at cp=1: SDPA's fused kernels are much faster than the tiled kernel's plain-torch online softmax
    (docs/MEASUREMENTS.md) and keep long sequences O(s) in memory."""
    b, groups, per_group, s, d = q.shape
    q4, k4, v4 = q.reshape(b, groups * per_group, s, d), k.squeeze(2), v.squeeze(2)
    segments = list(zip(bounds[:-1], bounds[1:]))
    prefix_of = prefix_of or (-1,) * len(segments)
    parts = []
    for (lo, hi), prefix in zip(segments, prefix_of):
        if hi == lo:
            continue
        if prefix < 0:
            parts.append(F.scaled_dot_product_attention(q4[:, :, lo:hi], k4[:, :, lo:hi], v4[:, :, lo:hi],
                                                        is_causal=True, scale=scale, enable_gqa=per_group > 1))
            continue
        # imported here: torch.nn.attention.bias imports dynamo, 1.6 s of every process's start-up otherwise
        from torch.nn.attention.bias import causal_lower_right

        p_lo, p_hi = segments[prefix]
        keys = torch.cat([k4[:, :, p_lo:p_hi], k4[:, :, lo:hi]], dim=2)
        values = torch.cat([v4[:, :, p_lo:p_hi], v4[:, :, lo:hi]], dim=2)
        # [ones | causal] over [prefix keys | own keys] is the causal mask aligned to the lower right: SDPA
        # takes it as a bias object (no mask tensor is built or cached)
        parts.append(F.scaled_dot_product_attention(q4[:, :, lo:hi], keys, values, attn_mask=causal_lower_right(
            hi - lo, p_hi - p_lo + hi - lo), scale=scale, enable_gqa=per_group > 1))
    return torch.cat(parts, dim=2).reshape(b, groups, per_group, s, d)


class ContextParallelAttention(MegatronModule):
    """Causal core attention over the CP group, for the local layer spec (see the module docstring).

    Accepts the inputs Megatron's ``SelfAttention`` gives its core attention: ``sbhd``
    (query ``[s, b, heads, d]``, key/value ``[s, b, kv_heads, d]``; the local ``s`` is this rank's
    head+tail chunks of a ``s * cp`` sequence) or packed ``thd`` (``[t, heads, d]`` with
    ``packed_seq_params.cu_seqlens_q_padded`` the global padded boundaries). Works at cp=1 too,
    which gives the local spec packed-sequence support.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None, block_size: int = 256):
        """Megatron's core-attention arguments (its attention module passes them by name), and ``block_size``:
        the query/key tile of the tiled kernels."""
        super().__init__(config=config)
        dropout = config.attention_dropout
        problems = []
        if attn_mask_type != AttnMaskType.causal:
            problems.append(f"attn_mask_type={attn_mask_type.name} (only causal is supported)")
        if dropout:
            problems.append(f"attention_dropout={dropout} (must be 0)")
        if config.softmax_type != "vanilla":
            problems.append(f"softmax_type={config.softmax_type!r} (only 'vanilla')")
        if config.window_size is not None:
            problems.append(f"window_size={config.window_size} (sliding windows are not supported)")
        comm = cp_comm_type or DEFAULT_CP_COMM_TYPE
        if comm not in CP_COMM_TYPES:
            problems.append(f"cp_comm_type={comm!r} (choose one of {CP_COMM_TYPES})")
        if problems:
            raise ValueError("ContextParallelAttention (parallel.cp_attention) cannot run this layer: "
                             + "; ".join(problems))
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.cp_group = pg_collection.cp
        self.cp_comm_type = comm
        self.block_size = block_size
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        tp = pg_collection.tp.size()
        self.heads = divide(config.num_attention_heads, tp)
        self.kv_heads = divide(config.num_query_groups, tp)
        self.head_dim = divide(config.kv_channels * config.num_attention_heads, config.num_attention_heads)
        # Megatron's query-key layer scaling divides the scale by the layer number and multiplies the
        # scores back before the softmax: the product is the plain scale, used directly here.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> Tensor:
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("ContextParallelAttention builds the causal mask from token positions: call "
                             "the model with attention_mask=None (packing handles sequence boundaries)")
        if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"ContextParallelAttention supports only causal masks, got {attn_mask_type}")
        cp_size = self.cp_group.size()
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:
            bounds = getattr(packed_seq_params, "padded_bounds", None)  # host boundaries: no device read
            if not bounds:
                cu = packed_seq_params.cu_seqlens_q_padded
                cu = packed_seq_params.cu_seqlens_q if cu is None else cu
                bounds = tuple(int(x) for x in cu.tolist())
            prefix_of = getattr(packed_seq_params, "prefix_of", None) or None
            if bounds[-1] != query.size(0) * cp_size:
                raise ValueError(f"packed batch: this rank holds {query.size(0)} tokens but cu_seqlens "
                                 f"(padded) end at {bounds[-1]} = {query.size(0) * cp_size} expected "
                                 f"for context_parallel_size {cp_size}")
            q, k, v = (x.unsqueeze(1) for x in (query, key, value))
        else:
            bounds, prefix_of = (0, query.size(0) * cp_size), None
            q, k, v = query, key, value
        # [s, b, n, d] -> [b, groups, per_group, s, d]
        s, b = q.size(0), q.size(1)
        q5 = q.permute(1, 2, 0, 3).reshape(b, self.kv_heads, self.heads // self.kv_heads, s, self.head_dim)
        k5 = k.permute(1, 2, 0, 3).unsqueeze(2)
        v5 = v.permute(1, 2, 0, 3).unsqueeze(2)
        sharing = prefix_of is not None and any(p >= 0 for p in prefix_of)
        if cp_size == 1 and sharing and flex_usable(q5, self.head_dim):  # shared-prefix row on a GPU
            block_mask = block_mask_for(packed_seq_params, bounds, prefix_of, q5.device)
            out = flex_packed_attention(q5, k5, v5, block_mask, self.softmax_scale)
        else:
            out = self._attend(q5, k5, v5, bounds, cp_size, prefix_of)
        out = out.reshape(b, self.heads, s, self.head_dim).permute(2, 0, 1, 3).reshape(s, b, -1)
        return out.squeeze(1) if thd else out

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, bounds: tuple[int, ...], cp_size: int,
                prefix_of: tuple[int, ...] | None) -> Tensor:
        if cp_size == 1:
            return per_sequence_attention(q, k, v, bounds, self.softmax_scale, prefix_of)
        if prefix_of is not None:
            raise ValueError(f"ContextParallelAttention: shared-prefix rows need context_parallel_size 1, "
                             f"got {cp_size}")
        rank = self.cp_group.rank()
        layouts = [TokenLayout.of_rank(bounds, cp_size, r) for r in range(cp_size)]
        if self.cp_comm_type == "p2p":
            return _RingAttention.apply(q, k.contiguous(), v.contiguous(), layouts,
                                        Tiling(self.softmax_scale, self.block_size), self.cp_group)
        # Autograd-aware: backward sums each rank's K/V gradients back to the owner (a reduce-scatter).
        k_all = all_gather_along(k, 3, self.cp_group)
        v_all = all_gather_along(v, 3, self.cp_group)
        k_layout = TokenLayout(torch.cat([lay.index for lay in layouts]),
                               torch.cat([lay.start for lay in layouts]))
        return _LocalTiledAttention.apply(q, k_all, v_all, (layouts[rank], k_layout),
                                          Tiling(self.softmax_scale, self.block_size))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """No parameters (vanilla softmax only), so nothing to checkpoint."""
        return {}
