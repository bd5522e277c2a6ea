"""Micro-batches of an experience (mini-)batch: token-budgeted packing, CP sharding, and the way back.

:func:`plan_micro_batches` groups sequences under a token budget, deterministically (every tensor-,
context- and pipeline-parallel rank of a replica computes the same plan from the same lengths):

* packed (``train.packing=True``): first-fit decreasing over the real lengths; a micro-batch is one
  row of concatenated sequences with ``cu_seqlens`` boundaries, so no compute is spent on padding.
* unpacked: sequences sorted by length, longest first, grouped while ``count * longest <= budget``;
  a micro-batch is a [n, longest] right-padded batch (Megatron's ordinary ``sbhd`` path).

* shared prefixes (packed, CP = 1, ``share_prefixes``): rows whose tokens before their first wanted
  output are equal (a GRPO group's samples, a preference pair) form trees (:mod:`parallel.shared_prefix`):
  those tokens, but the last, are one prefix segment computed once, each row's rest a branch segment.
  A tree is planned as one item costing its real token count; a group too big for the budget is split
  into several trees.

A sequence longer than the budget gets a micro-batch of its own (the budget bounds what can be
shared, not what a sequence needs). Under context parallelism the budget counts real tokens; each
sequence's split padding (fewer than ``2 * cp`` tokens) comes on top.

:func:`build_micro_batches` turns a plan into :class:`MicroBatch` objects holding this CP rank's
model inputs (through :mod:`parallel.context_parallel`): tokens, positions, the next-token labels of
each position and a mask of the positions whose output is wanted. :meth:`MicroBatch.to_rows` takes a
per-position output of the model (this rank's shard) back to the experience's token-aligned [n, L]
layout: the output at position t - 1 (predicting token t) lands in column t.

Routing replay (MoE actors): ``build_micro_batches(routing=...)`` also carries the batch's routing record
([B, L, moe_layers, top_k], token-aligned) into each micro-batch as :attr:`MicroBatch.routing`, in the order
Megatron's routers see the micro-batch's tokens (sequence-major: position s of row b is ``s * rows + b``), a
shared prefix's tokens once (from its tree's first row); :meth:`MicroBatch.token_rows` is the way back.

Sequence parallelism (``sequence_multiple`` = TP): each CP rank's part of a packed row must split evenly over
the TP ranks, so a padding segment (its own sequence: no wanted output, nothing attends to it) is appended
where needed and :attr:`MicroBatch.padding` marks it for the MoE routers; unpacked rows pad wider.

Devices: the plan and each micro-batch's fields are computed from the batch's lengths, and every tensor
a micro-batch holds (and :meth:`MicroBatch.to_rows` creates) is on the batch's device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from parallel.context_parallel import CPShardPlan, make_shard_plan, packed_seq_params_for, shard, unshard
from megarlhf.learner.routing_replay import UNROUTED
from parallel.shared_prefix import shared_prefix_seq_params


def plan_micro_batches(lengths: Sequence[int], budget: int, packed: bool = True,
                       groups: Sequence[Sequence[int]] | None = None,
                       shared: Sequence[int] | None = None) -> list[list[int]]:
    """Indices of the sequences of each micro-batch (ascending inside one); every index exactly once.

    ``groups`` (optional, a partition of the indices) keeps the sequences of a group in one micro-batch:
    the chosen and rejected responses of a preference pair, whose loss needs both, or the samples of a
    shared-prefix tree. ``shared[k]`` (packed only) is the number of leading tokens group k's sequences
    hold once between them (its tree's prefix), so the group costs ``sum(lengths) - (size - 1) * shared``.
    """
    if budget < 1:
        raise ValueError(f"plan_micro_batches: the token budget must be >= 1, got {budget}")
    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"plan_micro_batches: need at least one sequence, all of length >= 1; got {lengths}")
    items = [list(g) for g in groups] if groups is not None else [[i] for i in range(len(lengths))]
    if sorted(i for g in items for i in g) != list(range(len(lengths))):
        raise ValueError("plan_micro_batches: groups must hold every sequence index exactly once")
    shared = [0] * len(items) if shared is None else [int(c) for c in shared]
    if len(shared) != len(items) or (not packed and any(shared)):
        raise ValueError("plan_micro_batches: shared needs one entry per group, and packing")
    longest = [max(lengths[i] for i in g) for g in items]
    total = [sum(lengths[i] for i in g) - (len(g) - 1) * c for g, c in zip(items, shared)]
    order = sorted(range(len(items)), key=lambda k: (-longest[k], min(items[k])))
    bins: list[list[int]] = []
    if packed:
        loads: list[int] = []
        for k in order:
            target = next((b for b, load in enumerate(loads) if load + total[k] <= budget), None)
            if target is None:
                bins.append(list(items[k]))
                loads.append(total[k])
            else:
                bins[target] += items[k]
                loads[target] += total[k]
    else:
        widths: list[int] = []
        for k in order:  # longest first: a bin's first item holds its longest sequence
            if bins and (len(bins[-1]) + len(items[k])) * widths[-1] <= budget:
                bins[-1] += items[k]
            else:
                bins.append(list(items[k]))
                widths.append(longest[k])
    return [sorted(b) for b in bins]


@dataclass
class MicroBatch:
    """One micro-batch on this CP rank: model inputs and the way back to token-aligned rows."""

    rows: Tensor  # [n] rows of the (mini-)batch, in micro-batch order
    lengths: Tensor  # [n] real lengths
    host_lengths: tuple[int, ...]  # the same lengths on the host: sizes are read from them, not the device
    tokens: Tensor  # packed: [1, T_local]; unpacked: [n, S_local]
    position_ids: Tensor  # same shape as tokens
    labels: Tensor  # same shape: the token each position predicts (0 where none)
    label_mask: Tensor  # same shape, bool: positions whose output is wanted
    packed_seq_params: object | None  # Megatron PackedSeqParams (packed) or None
    plan: CPShardPlan  # the CP split of the packed row, or of every unpacked row
    cp_group: object | None = None
    # packed: [n, width + 1] the packed position whose output predicts token t of row j (column 0: any;
    # column n_j: the output at row j's last token)
    source: Tensor | None = None
    # the routing to replay, [tokens, moe_layers, top_k] in the routers' token order (module docstring), or None
    routing: Tensor | None = None
    # shape of ``tokens``, True on the padding segment that makes the row split evenly over sequence-parallel
    # ranks (module docstring; None: no such segment)
    padding: Tensor | None = None
    # how many positions ``label_mask`` wants, on the host once the schedule has read it (None: not yet)
    wanted_tokens: int | None = None
    # shape of ``tokens`` + [K]: K more vocabulary ids per position whose log-probs a pass wants besides the
    # label's (a distillation loss's: the teacher's top-k; :meth:`to_positions`), or None
    target_ids: Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.packed_seq_params is not None

    @property
    def width(self) -> int:
        return max(self.host_lengths)

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequences the model computes (a shared prefix counts once; padding does not)."""
        return self.plan.total_tokens - self.padding_tokens if self.packed else sum(self.host_lengths)

    @property
    def padding_tokens(self) -> int:
        """Tokens of the padding segment (packed rows under sequence parallelism; 0 without one)."""
        return self.plan.total_tokens - self.plan.bounds[-2] if self.padding is not None else 0

    def to_rows(self, local: Tensor) -> Tensor:
        """This rank's per-position outputs (shape of ``tokens``, plus any trailing dims) -> [n, width, ...],
        token-aligned.

        Collective over the CP group (an autograd-aware all-gather); unwanted positions are 0.
        """
        if tuple(local.shape[:self.tokens.dim()]) != tuple(self.tokens.shape):
            raise ValueError(f"MicroBatch.to_rows: outputs of shape {tuple(local.shape)}, expected the "
                             f"tokens' {tuple(self.tokens.shape)}")
        n, width = len(self.host_lengths), self.width
        trailing = tuple(local.shape[self.tokens.dim():])
        if self.packed:
            shifted = unshard(self.plan, local[0], self.cp_group)[self.source[:, :width]]  # [T] -> [n, width]
        else:
            full = unshard(self.plan, local, self.cp_group, seq_dim=1)  # [n, S]
            shifted = torch.cat([full.new_zeros(n, 1, *trailing), full[:, :width - 1]], dim=1)
        valid = self._valid_columns(local.device).view(n, width, *[1] * len(trailing))
        return torch.where(valid, shifted, shifted.new_zeros(()))

    def _valid_columns(self, device) -> Tensor:
        """[n, width] bool: the columns an output lands in (1 .. length - 1 of each row)."""
        cols = torch.arange(self.width, device=device)
        return (cols[None, :] >= 1) & (cols[None, :] < self.lengths[:, None])

    def to_positions(self, rows: Tensor) -> Tensor:
        """The way in, the inverse of :meth:`to_rows`: a token-aligned [n, width, ...] tensor of the micro-batch's
        rows -> this CP rank's per-position layout (shape of ``tokens`` plus the trailing dims), column t at the
        position whose output predicts token t; positions no column lands in hold 0. (A shared prefix's
        positions are written by every row of its tree; no output is wanted there.)"""
        n, width = len(self.host_lengths), self.width
        if tuple(rows.shape[:2]) != (n, width):
            raise ValueError(f"MicroBatch.to_positions: rows of shape {tuple(rows.shape)}, expected ({n}, {width}, ...)")
        trailing = tuple(rows.shape[2:])
        valid = self._valid_columns(rows.device)
        if self.packed:
            full = rows.new_zeros((self.plan.total_tokens, *trailing))
            full[self.source[:, :width][valid]] = rows[valid]
            return shard(self.plan, full, 0, 0).unsqueeze(0)
        full = rows.new_zeros((n, self.plan.total_tokens, *trailing))
        full[:, :width - 1] = torch.where(valid[:, 1:].view(n, width - 1, *[1] * len(trailing)), rows[:, 1:], 0)
        return shard(self.plan, full, 0, seq_dim=1)

    def token_rows(self, local: Tensor) -> Tensor:
        """A per-token tensor in the routers' token order (``[tokens, ...]``, this CP rank's, e.g. the routing
        its routers chose) -> [n, width, ...], token-aligned: column t holds token t's entry (``UNROUTED``
        beyond a row's length). Collective over the CP group."""
        from megarlhf.learner.routing_replay import UNROUTED

        n, width = len(self.host_lengths), self.width
        if self.packed:
            full = unshard(self.plan, local.int(), self.cp_group).to(local.dtype)  # gloo gathers no int16
            rows = full[self.source[:, 1:width + 1]]  # token t sits where the output predicting t + 1 comes from
        else:
            per_row = local.view(-1, n, *local.shape[1:]).transpose(0, 1)  # sequence-major -> [n, S_local, ...]
            rows = unshard(self.plan, per_row.int(), self.cp_group, seq_dim=1).to(local.dtype)[:, :width]
        beyond = torch.arange(width, device=local.device)[None, :] >= self.lengths[:, None]
        return rows.masked_fill(beyond.view(n, width, *[1] * (rows.dim() - 2)), UNROUTED)

    def last_token_outputs(self, local: Tensor) -> Tensor:
        """This rank's per-position outputs (shape of ``tokens``) -> [n]: the output at each sequence's
        last token (a reward model's score). Collective over the CP group, autograd-aware."""
        if tuple(local.shape) != tuple(self.tokens.shape):
            raise ValueError(f"MicroBatch.last_token_outputs: outputs of shape {tuple(local.shape)}, expected the "
                             f"tokens' {tuple(self.tokens.shape)}")
        if self.packed:
            full = unshard(self.plan, local[0], self.cp_group)  # [T]
            return full[self.source.gather(1, self.lengths[:, None]).squeeze(1)]  # column n: position n - 1
        full = unshard(self.plan, local, self.cp_group, seq_dim=1)  # [n, S]
        return full.gather(1, (self.lengths - 1)[:, None]).squeeze(1)


@dataclass(frozen=True)
class _Tree:
    """Rows packed together; when ``shared`` > 0 they begin with the same ``shared`` tokens, held once."""

    rows: tuple[int, ...]
    shared: int = 0


def _trees(token_lists: list[list[int]], lengths: list[int], first: list[int], budget: int,
           groups: Sequence[Sequence[int]] | None) -> list[_Tree]:
    """The shared-prefix trees of a batch: rows whose tokens before their first wanted output are equal.

    The shared part stops one token short of the first wanted output, so every wanted output (and every
    label that differs between rows) lies in a row's own branch. Without ``groups``, rows with equal
    prefixes form trees of at most ``budget`` tokens (in row order); with ``groups`` each group is one tree,
    sharing only if all its rows have the same prefix.
    """
    keys = [tuple(token_lists[r][:max(f - 1, 0)]) for r, f in enumerate(first)]
    if groups is not None:
        trees = []
        for group in groups:
            same = len({keys[r] for r in group}) == 1 and len(group) > 1
            trees.append(_Tree(tuple(group), len(keys[group[0]]) if same else 0))
        return trees
    by_key: dict[tuple, list[int]] = {}
    for row, key in enumerate(keys):
        by_key.setdefault(key if key else (row, "alone"), []).append(row)
    trees = []
    for rows in by_key.values():
        shared, chunk, size = len(keys[rows[0]]), [], 0
        for row in rows:
            cost = lengths[row] - (shared if chunk else 0)
            if chunk and size + cost > budget:
                trees.append(_Tree(tuple(chunk), shared if len(chunk) > 1 else 0))
                chunk, size, cost = [], 0, lengths[row]
            chunk.append(row)
            size += cost
        trees.append(_Tree(tuple(chunk), shared if len(chunk) > 1 else 0))
    return trees


def _next_token_fields(input_ids: Tensor, lengths: Sequence[int], wanted: Tensor):
    """Per-sequence (labels, label_mask) lists: position t predicts token t + 1 of the same sequence."""
    labels, masks = [], []
    for ids, n, want in zip(input_ids, lengths, wanted):
        labels.append(torch.cat([ids[1:n], ids.new_zeros(1)]))
        masks.append(torch.cat([want[1:n], want.new_zeros(1)]))
    return labels, masks


@dataclass
class _Segments:
    """A packed row being built: its segments' tokens, labels, masks and positions, and per row where
    each output comes from."""

    tokens: list = field(default_factory=list)
    labels: list = field(default_factory=list)
    masks: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    prefix_of: list = field(default_factory=list)
    bounds: list = field(default_factory=lambda: [0])
    sources: list = field(default_factory=list)
    routing: list = field(default_factory=list)

    def add(self, tokens: Tensor, labels: Tensor, mask: Tensor, first_position: int, prefix: int = -1,
            routing: Tensor | None = None) -> int:
        """Appends a segment (and its tokens' routing, when replayed); returns its start in the packed row."""
        start = self.bounds[-1]
        if routing is not None:
            self.routing.append(routing)
        self.tokens.append(tokens)
        self.labels.append(labels)
        self.masks.append(mask)
        self.positions.append(torch.arange(first_position, first_position + tokens.numel(), device=tokens.device))
        self.prefix_of.append(prefix)
        self.bounds.append(start + tokens.numel())
        return start

    def add_tree(self, ids: Tensor, lens: Sequence[int], wanted: Tensor, shared: int, width: int,
                 routing: Tensor | None = None) -> None:
        """The rows of one tree: a prefix segment of ``shared`` tokens (if > 0), then one segment per row.
        ``routing`` (the rows' records) gives the prefix its first row's routing."""
        labels, masks = _next_token_fields(ids, lens, wanted)
        cols = torch.arange(width + 1, device=ids.device) - 1  # column t reads the output at position t - 1
        prefix_start, prefix_index = 0, len(self.prefix_of)
        part = (lambda i, lo, hi: None) if routing is None else (lambda i, lo, hi: routing[i, lo:hi])
        if shared:
            prefix_start = self.add(ids[0, :shared], labels[0][:shared], torch.zeros_like(masks[0][:shared]), 0,
                                    routing=part(0, 0, shared))
        for i, n in enumerate(lens):
            start = self.add(ids[i, shared:n], labels[i][shared:], masks[i][shared:], shared,
                             prefix_index if shared else -1, routing=part(i, shared, n))
            self.sources.append(torch.where(cols < shared, prefix_start + cols, start + cols - shared))

    def pad_to(self, multiple: int, cp_size: int, routing: Tensor | None) -> bool:
        """Appends a padding segment (pad tokens, no labels, no wanted outputs) so that every CP rank's share
        of the row is a multiple of ``multiple`` tokens; returns whether it did. Under CP each segment is
        padded to a multiple of ``2 * cp`` (:mod:`parallel.cp_sharding`), and so is this one."""
        unit = 2 * cp_size if cp_size > 1 else 1
        padded = sum(-(-(hi - lo) // unit) * unit for lo, hi in zip(self.bounds[:-1], self.bounds[1:]))
        short = next(k * unit for k in range(multiple * cp_size + 1) if (padded + k * unit) % (multiple * cp_size) == 0)
        if not short:
            return False
        zeros = self.tokens[0].new_zeros(short)
        pad_routing = None if routing is None else routing.new_full((short, *routing.shape[2:]), UNROUTED)
        self.add(zeros, zeros, zeros.bool(), 0, routing=pad_routing)
        return True

    def fields(self):
        total = self.bounds[-1]
        source = torch.stack(self.sources).clamp(0, total - 1)
        return (torch.cat(self.tokens), torch.cat(self.labels), torch.cat(self.masks), torch.cat(self.positions),
                source, torch.cat(self.routing) if self.routing else None)


@dataclass(frozen=True)
class Packing:
    """How a batch is cut into micro-batches: at most ``budget`` tokens each, packed into one row (or
    right-padded rows), for context-parallel rank ``cp_rank`` of ``cp_size`` (``cp_group``); with
    ``share_prefixes`` (packed, CP = 1) rows that begin alike are packed as shared-prefix trees
    (:mod:`parallel.shared_prefix`): the common tokens before the first wanted output are computed once;
    every CP rank's part of a micro-batch is a multiple of ``sequence_multiple`` (the tensor-parallel size
    of a sequence-parallel model; packed: a padding segment, unpacked: wider padding)."""

    budget: int
    packed: bool = True
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: object = None
    share_prefixes: bool = False
    sequence_multiple: int = 1


class _Batch(NamedTuple):
    """The batch a micro-batch takes its rows from (``host_lengths``: the lengths, read once)."""

    input_ids: Tensor
    lengths: Tensor
    host_lengths: list[int]
    wanted: Tensor
    routing: Tensor | None


def build_micro_batches(input_ids: Tensor, lengths: Tensor, wanted: Tensor, packing: Packing,
                        groups: Sequence[Sequence[int]] | None = None, routing: Tensor | None = None
                        ) -> list[MicroBatch]:
    """The micro-batches of a batch of sequences, for this CP rank, as ``packing`` says.

    ``input_ids`` [B, L], ``lengths`` [B]; ``wanted`` [B, L] bool, token-aligned: the tokens whose
    output (log-prob, value) the caller needs (e.g. the response mask); column 0 is ignored. The
    micro-batches live on ``input_ids``' device; ``groups`` keep rows together (:func:`plan_micro_batches`).
    ``routing`` ([B, L, moe_layers, top_k]): the record each micro-batch replays (module docstring).
    """
    if wanted.shape != input_ids.shape:
        raise ValueError(f"build_micro_batches: wanted has shape {tuple(wanted.shape)}, input_ids "
                         f"{tuple(input_ids.shape)}")
    if routing is not None and tuple(routing.shape[:2]) != tuple(input_ids.shape):
        raise ValueError(f"build_micro_batches: routing has shape {tuple(routing.shape)}, input_ids "
                         f"{tuple(input_ids.shape)}")
    share_prefixes = packing.share_prefixes
    if share_prefixes and (not packing.packed or packing.cp_size != 1):
        raise ValueError(f"build_micro_batches: shared prefixes need packing and context parallel size 1 "
                         f"(packed={packing.packed}, cp_size={packing.cp_size})")
    device = input_ids.device
    wanted = wanted.bool() & (torch.arange(input_ids.shape[1], device=device)[None, :] < lengths[:, None])
    host_lengths, token_lists, first = _host_rows(input_ids, lengths, wanted, share_prefixes)
    if share_prefixes:
        trees = _trees(token_lists, host_lengths, first, packing.budget, groups)
    else:
        trees = [_Tree(tuple(g)) for g in groups] if groups is not None else [
            _Tree((r,)) for r in range(len(host_lengths))]
    tree_of = {row: tree for tree in trees for row in tree.rows}
    plan_rows = plan_micro_batches(host_lengths, packing.budget, packing.packed, [t.rows for t in trees],
                                   [t.shared for t in trees] if packing.packed else None)
    batch = _Batch(input_ids, lengths, host_lengths, wanted, routing)
    bins = [list(dict.fromkeys(tree_of[r] for r in bin_rows)) for bin_rows in plan_rows]  # trees in row order
    orders = [[r for tree in trees for r in tree.rows] for trees in bins] if packing.packed else plan_rows
    # every micro-batch's rows in one host-to-device copy per pass (not one small tensor per row or tree)
    all_rows = torch.tensor([r for order in orders for r in order], dtype=torch.long, device=device)
    result, start = [], 0
    for trees, order in zip(bins, orders):
        rows = all_rows[start:start + len(order)]
        start += len(order)
        if packing.packed:
            result.append(_packed_micro_batch(batch, trees, packing, rows))
        else:
            result.append(_padded_micro_batch(batch, order, packing, rows))
    return result


def _host_rows(input_ids: Tensor, lengths: Tensor, wanted: Tensor, with_tokens: bool):
    """What the plan needs on the host, read in one device-to-host transfer: the lengths and, for shared
    prefixes, every row's tokens and first wanted column ((lengths, None, None) without)."""
    if not with_tokens:
        return lengths.tolist(), None, None  # host: the plan is made there
    first = torch.where(wanted.any(1), wanted.int().argmax(1), lengths)
    rows = torch.cat([lengths[:, None], first[:, None], input_ids.long()], dim=1).tolist()  # host: one read
    return [r[0] for r in rows], [r[2:] for r in rows], [r[1] for r in rows]


def _packed_micro_batch(batch: _Batch, trees: list[_Tree], packing: Packing, rows: Tensor) -> MicroBatch:
    """One packed row of ``trees`` (its rows in tree order; ``rows``: their indices, on the device), sharded
    for this CP rank."""
    input_ids, lengths, host_lengths, wanted, routing = batch
    cp_size, cp_rank, cp_group = packing.cp_size, packing.cp_rank, packing.cp_group
    device = input_ids.device
    order = [r for tree in trees for r in tree.rows]
    lens = tuple(host_lengths[r] for r in order)
    width = max(lens)
    row, first = _Segments(), 0
    for tree in trees:
        index, first = rows[first:first + len(tree.rows)], first + len(tree.rows)
        row.add_tree(input_ids[index], [host_lengths[r] for r in tree.rows], wanted[index], tree.shared, width,
                     None if routing is None else routing[index])
    padded = row.pad_to(packing.sequence_multiple, cp_size, routing)
    tokens, labels, masks, positions, source, row_routing = row.fields()
    plan = make_shard_plan(row.bounds, cp_size, cp_rank).to(device)
    fields = [shard(plan, t, 0).unsqueeze(0) for t in (tokens, labels, masks)]
    if any(tree.shared for tree in trees):
        # every row's logical positions run 0 .. length - 1: the rotary table must reach the widest row
        params = shared_prefix_seq_params(plan, tuple(row.prefix_of), positions, width, cp_group)
        positions = positions.unsqueeze(0)
    else:
        local_positions = plan.local_position_ids()
        params = packed_seq_params_for(plan, cp_group, local_positions if cp_size == 1 else None)
        positions = local_positions.unsqueeze(0)
    local_routing = None if row_routing is None else shard(plan, row_routing, UNROUTED, 0)
    padding = None
    if padded:
        full = torch.zeros(plan.total_tokens, dtype=torch.bool, device=device)
        full[plan.bounds[-2]:] = True
        padding = shard(plan, full, True, 0).unsqueeze(0)
    return MicroBatch(rows, lengths[rows], lens, fields[0], positions, fields[1], fields[2], params, plan, cp_group,
                      source, local_routing, padding)


def _padded_micro_batch(batch: _Batch, bin_rows: list[int], packing: Packing, rows: Tensor) -> MicroBatch:
    """One right-padded [n, width] micro-batch (``rows``: ``bin_rows`` on the device), each row sharded for
    this CP rank."""
    input_ids, lengths, host_lengths, wanted, routing = batch
    cp_size, cp_rank, cp_group = packing.cp_size, packing.cp_rank, packing.cp_group
    device = input_ids.device
    lens = tuple(host_lengths[r] for r in bin_rows)
    ids = input_ids[rows]
    labels, masks = _next_token_fields(ids, lens, wanted[rows])
    width = max(lens)
    multiple = math.lcm(2 * cp_size if cp_size > 1 else 1, cp_size * packing.sequence_multiple)
    padded = -(-width // multiple) * multiple
    plan = make_shard_plan([0, padded], cp_size, cp_rank, allow_padding=False).to(device)
    full = [torch.zeros(len(bin_rows), padded, dtype=dtype, device=device)
            for dtype in (torch.long, torch.long, torch.bool)]
    for i, n in enumerate(lens):
        full[0][i, :n], full[1][i, :n], full[2][i, :n] = ids[i, :n], labels[i], masks[i]
    fields = [shard(plan, t, 0, seq_dim=1) for t in full]
    positions = plan.local_position_ids().unsqueeze(0).expand(len(bin_rows), -1)
    local_routing = None
    if routing is not None:  # [n, S_local, layers, top_k] -> sequence-major tokens
        full_routing = torch.full((len(bin_rows), padded, *routing.shape[2:]), UNROUTED, dtype=routing.dtype,
                                  device=device)
        for i, (row, n) in enumerate(zip(bin_rows, lens)):
            full_routing[i, :n] = routing[row, :n]
        local_routing = shard(plan, full_routing, UNROUTED, seq_dim=1).transpose(0, 1).reshape(
            -1, *routing.shape[2:])
    return MicroBatch(rows, lengths[rows], lens, fields[0], positions, fields[1], fields[2], None, plan, cp_group,
                      routing=local_routing)
