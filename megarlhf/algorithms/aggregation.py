"""Reduces a per-token loss [B, T] to this micro-batch's share of the step's global loss.

One optimiser step sees a global batch split over data-parallel (DP) ranks and, on each rank, over
micro-batches. A mean taken per micro-batch and then averaged is not the mean over the global batch
when micro-batches hold different numbers of tokens or sequences. So the normalisers are computed once
per step over the whole global batch (:func:`compute_normaliser`: token and sequence counts summed over
this rank's micro-batches and all-reduced over the DP group), and :func:`aggregate_loss` divides each
micro-batch's sum by them.

Modes (``l_it`` per-token loss, ``m_it`` response mask, ``n_i = sum_t m_it``, sums over the global
batch, ``N_tok = sum_i n_i``, ``N_seq`` = sequences with at least one response token):

* ``token_mean``:              ``sum_it m_it l_it / N_tok``
* ``seq_mean_token_sum``:      ``sum_i (sum_t m_it l_it) / N_seq``
* ``seq_mean_token_mean``:     ``sum_i (sum_t m_it l_it / n_i) / N_seq``
* ``seq_mean_token_sum_norm``: ``sum_it m_it l_it / (N_seq * L)`` with the constant ``L`` = the maximum
  response length (Liu et al. 2025, "Understanding R1-Zero-Like Training", Dr. GRPO).

Data-parallel factor. Megatron-Core's DDP (``calculate_per_token_loss=False``) sums gradients over the
DP group and multiplies them by ``1 / dp_size``. To make the gradient every rank applies equal the
gradient of the global loss, each share is multiplied by ``normaliser.grad_average_factor`` (the DP
size): the shares of all micro-batches of all ranks then sum to ``dp_size * global loss``, and DDP's
average brings the gradient back to that of the global loss. To log the global loss, all-reduce-sum the
shares and divide by ``grad_average_factor``. (Megatron's ``forward_backward_func`` also divides a
loss returned as a 2-tuple by ``num_microbatches``; a trainer handing it these shares must undo that.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from megarlhf.algorithms._checks import all_reduce_sum, check_mask, check_shape, group_size, zero_masked
from megarlhf.config.algorithm import AGGREGATION_MODES


@dataclass(frozen=True)
class LossNormaliser:
    """The global counts of one optimiser step, identical on every DP rank."""

    num_tokens: int  # response tokens over all micro-batches of all DP ranks
    num_sequences: int  # sequences with at least one response token, same scope
    grad_average_factor: int  # ranks over which DDP averages gradients (the DP size)
    max_response_length: int | None  # the Dr. GRPO constant L (seq_mean_token_sum_norm only)


def compute_normaliser(masks: Sequence[Tensor], dp_group=None,
                       max_response_length: int | None = None) -> LossNormaliser:
    """Counts the step's response tokens and sequences over every micro-batch mask of this rank and
    every rank of ``dp_group`` (None: this process is the whole batch). Call it once per step, with
    the masks of all micro-batches the step will see, on every rank of the group. A step whose global
    batch has no response token gets ``num_tokens == 0`` (:func:`aggregate_loss` refuses it; the
    trainers skip such a step).
    """
    if len(masks) == 0:
        raise ValueError("compute_normaliser: masks is empty; pass the response mask of every micro-batch")
    counts = torch.zeros(2, dtype=torch.float64, device=masks[0].device)
    for index, mask in enumerate(masks):
        mask = check_mask("compute_normaliser", f"masks[{index}]", mask)
        counts += torch.stack([mask.sum(), mask.any(dim=1).sum()]).to(torch.float64)
    num_tokens, num_sequences = (int(c) for c in all_reduce_sum(counts, dp_group).tolist())
    if max_response_length is not None and not max_response_length > 0:
        raise ValueError(f"compute_normaliser: max_response_length must be > 0, got {max_response_length}")
    return LossNormaliser(num_tokens=num_tokens, num_sequences=num_sequences,
                          grad_average_factor=group_size(dp_group),
                          max_response_length=max_response_length)


def aggregate_loss(loss: Tensor, mask: Tensor, mode: str, normaliser: LossNormaliser) -> Tensor:
    """This micro-batch's share (a scalar) of the step's global loss in ``mode``, times the DP factor.

    Summed over every micro-batch of every DP rank, the shares give ``grad_average_factor`` times the
    global loss of the module docstring; backpropagating each share and letting DDP average gradients
    gives exactly the gradient of the global loss. Padding of ``loss`` is never read.
    """
    mask = check_mask("aggregate_loss", "mask", mask)
    check_shape("aggregate_loss", "loss", loss, tuple(mask.shape))
    if normaliser.num_tokens == 0:
        raise ValueError("aggregate_loss: the step's global batch has no response token (nothing to average; "
                         "a trainer skips such a step instead)")
    masked = zero_masked(loss, mask)
    factor = float(normaliser.grad_average_factor)
    if mode == "token_mean":
        return masked.sum() * (factor / normaliser.num_tokens)
    if mode == "seq_mean_token_sum":
        return masked.sum() * (factor / normaliser.num_sequences)
    if mode == "seq_mean_token_mean":
        per_sequence = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1).to(masked.dtype)
        return per_sequence.sum() * (factor / normaliser.num_sequences)
    if mode == "seq_mean_token_sum_norm":
        if normaliser.max_response_length is None:
            raise ValueError("aggregate_loss: mode 'seq_mean_token_sum_norm' needs "
                             "compute_normaliser(..., max_response_length=...)")
        denominator = normaliser.num_sequences * normaliser.max_response_length
        return masked.sum() * (factor / denominator)
    raise ValueError(f"aggregate_loss: unknown mode {mode!r}; known: {', '.join(AGGREGATION_MODES)}")
