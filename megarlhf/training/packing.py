"""Micro-batches of an experience (mini-)batch: token-budgeted packing, CP sharding, and the way back.

:func:`plan_micro_batches` groups sequences under a token budget, deterministically (every tensor-,
context- and pipeline-parallel rank of a replica computes the same plan from the same lengths):

* packed (``train.packing=True``): first-fit decreasing over the real lengths; a micro-batch is one
  row of concatenated sequences with ``cu_seqlens`` boundaries, so no compute is spent on padding.
* unpacked: sequences sorted by length, longest first, grouped while ``count * longest <= budget``;
  a micro-batch is a [n, longest] right-padded batch (Megatron's ordinary ``sbhd`` path).

A sequence longer than the budget gets a micro-batch of its own (the budget bounds what can be
shared, not what a sequence needs). Under context parallelism the budget counts real tokens; each
sequence's split padding (fewer than ``2 * cp`` tokens) comes on top.

:func:`build_micro_batches` turns a plan into :class:`MicroBatch` objects holding this CP rank's
model inputs (through :mod:`parallel.context_parallel`): tokens, positions, the next-token labels of
each position and a mask of the positions whose output is wanted. :meth:`MicroBatch.to_rows` takes a
per-position output of the model (this rank's shard) back to the experience's token-aligned [n, L]
layout: the output at position t - 1 (predicting token t) lands in column t.

Devices: the plan and each micro-batch's fields are computed from the batch's lengths, and every tensor
a micro-batch holds (and :meth:`MicroBatch.to_rows` creates) is on the batch's device.

Hand-written because the budgeted grouping and the token-aligned round trip are the project's own
contract; the CP split itself is :mod:`parallel.cp_sharding`'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from parallel.context_parallel import CPShardPlan, make_shard_plan, packed_seq_params_for, shard, unshard


def plan_micro_batches(lengths: Sequence[int], budget: int, packed: bool = True,
                       groups: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """Indices of the sequences of each micro-batch (ascending inside one); every index exactly once.

    ``groups`` (optional, a partition of the indices) keeps the sequences of a group in one micro-batch:
    the chosen and rejected responses of a preference pair, whose loss needs both.
    """
    if budget < 1:
        raise ValueError(f"plan_micro_batches: the token budget must be >= 1, got {budget}")
    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"plan_micro_batches: need at least one sequence, all of length >= 1; got {lengths}")
    items = [list(g) for g in groups] if groups is not None else [[i] for i in range(len(lengths))]
    if sorted(i for g in items for i in g) != list(range(len(lengths))):
        raise ValueError("plan_micro_batches: groups must hold every sequence index exactly once")
    longest = [max(lengths[i] for i in g) for g in items]
    total = [sum(lengths[i] for i in g) for g in items]
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
    tokens: Tensor  # packed: [1, T_local]; unpacked: [n, S_local]
    position_ids: Tensor  # same shape as tokens
    labels: Tensor  # same shape: the token each position predicts (0 where none)
    label_mask: Tensor  # same shape, bool: positions whose output is wanted
    packed_seq_params: object | None  # Megatron PackedSeqParams (packed) or None
    plan: CPShardPlan  # the CP split of the packed row, or of every unpacked row
    cp_group: object | None = None

    @property
    def packed(self) -> bool:
        return self.packed_seq_params is not None

    @property
    def width(self) -> int:
        return int(self.lengths.max())

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def to_rows(self, local: Tensor) -> Tensor:
        """This rank's per-position outputs (shape of ``tokens``) -> [n, width], token-aligned.

        Collective over the CP group (an autograd-aware all-gather); unwanted positions are 0.
        """
        if tuple(local.shape) != tuple(self.tokens.shape):
            raise ValueError(f"MicroBatch.to_rows: outputs of shape {tuple(local.shape)}, expected the "
                             f"tokens' {tuple(self.tokens.shape)}")
        n, width = self.lengths.numel(), self.width
        cols = torch.arange(width, device=local.device)
        if self.packed:
            full = unshard(self.plan, local[0], self.cp_group)  # [T]: output at each packed position
            starts = self.plan.cu_seqlens[:-1].long()
            index = (starts[:, None] + cols[None, :] - 1).clamp(0, full.numel() - 1)
            shifted = full[index]
        else:
            full = unshard(self.plan, local, self.cp_group, seq_dim=1)  # [n, S]
            shifted = torch.cat([full.new_zeros(n, 1), full[:, :width - 1]], dim=1)
        valid = (cols[None, :] >= 1) & (cols[None, :] < self.lengths[:, None])
        return torch.where(valid, shifted, shifted.new_zeros(()))


    def last_token_outputs(self, local: Tensor) -> Tensor:
        """This rank's per-position outputs (shape of ``tokens``) -> [n]: the output at each sequence's
        last token (a reward model's score). Collective over the CP group, autograd-aware."""
        if tuple(local.shape) != tuple(self.tokens.shape):
            raise ValueError(f"MicroBatch.last_token_outputs: outputs of shape {tuple(local.shape)}, expected the "
                             f"tokens' {tuple(self.tokens.shape)}")
        if self.packed:
            full = unshard(self.plan, local[0], self.cp_group)  # [T]
            return full[self.plan.cu_seqlens[1:].long() - 1]
        full = unshard(self.plan, local, self.cp_group, seq_dim=1)  # [n, S]
        return full.gather(1, (self.lengths - 1)[:, None]).squeeze(1)


def _next_token_fields(input_ids: Tensor, lengths: Tensor, wanted: Tensor):
    """Per-sequence (labels, label_mask) lists: position t predicts token t + 1 of the same sequence."""
    labels, masks = [], []
    for ids, n, want in zip(input_ids, lengths.tolist(), wanted):
        labels.append(torch.cat([ids[1:n], ids.new_zeros(1)]))
        masks.append(torch.cat([want[1:n], want.new_zeros(1)]))
    return labels, masks


def build_micro_batches(input_ids: Tensor, lengths: Tensor, wanted: Tensor, budget: int, *, packed: bool = True,
                        cp_size: int = 1, cp_rank: int = 0, cp_group=None,
                        groups: Sequence[Sequence[int]] | None = None) -> list[MicroBatch]:
    """The micro-batches of a batch of sequences, for this CP rank.

    ``input_ids`` [B, L], ``lengths`` [B]; ``wanted`` [B, L] bool, token-aligned: the tokens whose
    output (log-prob, value) the caller needs (e.g. the response mask); column 0 is ignored. The
    micro-batches live on ``input_ids``' device; ``groups`` keep rows together (:func:`plan_micro_batches`).
    """
    if wanted.shape != input_ids.shape:
        raise ValueError(f"build_micro_batches: wanted has shape {tuple(wanted.shape)}, input_ids "
                         f"{tuple(input_ids.shape)}")
    device = input_ids.device
    wanted = wanted.bool() & (torch.arange(input_ids.shape[1], device=device)[None, :] < lengths[:, None])
    result = []
    for rows in plan_micro_batches(lengths.tolist(), budget, packed, groups):
        rows = torch.tensor(rows, dtype=torch.long, device=device)
        ids, lens = input_ids[rows], lengths[rows]
        labels, masks = _next_token_fields(ids, lens, wanted[rows])
        if packed:
            plan = make_shard_plan([0, *lens.cumsum(0).tolist()], cp_size, cp_rank).to(device)
            row = torch.cat([ids[i, :n] for i, n in enumerate(lens.tolist())])
            fields = [shard(plan, t, 0).unsqueeze(0) for t in (row, torch.cat(labels), torch.cat(masks))]
            positions = plan.local_position_ids().unsqueeze(0)
            params = packed_seq_params_for(plan, cp_group)
        else:
            width = int(lens.max())
            multiple = 2 * cp_size if cp_size > 1 else 1
            padded = -(-width // multiple) * multiple
            plan = make_shard_plan([0, padded], cp_size, cp_rank, allow_padding=False).to(device)
            full = [torch.zeros(len(rows), padded, dtype=dtype, device=device)
                    for dtype in (torch.long, torch.long, torch.bool)]
            for i, n in enumerate(lens.tolist()):
                full[0][i, :n], full[1][i, :n], full[2][i, :n] = ids[i, :n], labels[i], masks[i]
            fields = [shard(plan, t, 0, seq_dim=1) for t in full]
            positions = plan.local_position_ids().unsqueeze(0).expand(len(rows), -1)
            params = None
        result.append(MicroBatch(rows, lens, fields[0], positions, fields[1], fields[2], params, plan, cp_group))
    return result
