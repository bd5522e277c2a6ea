"""The log-probability of "the rest of the vocabulary": the tokens outside a set of ids (a teacher's top-k), which
a distillation loss compares as one more category beside them.

It is summed from its own terms, in the log domain: a running log-sum-exp of the outside logits with its own
maximum (:class:`RunningLogSumExp`). Neither shortcut survives a confident model: 1 minus the set's fp32
probabilities keeps nothing below ~1e-6 (log-probs of logits near 30 are exact to ~2e-6), and a sum relative to
the row's overall maximum underflows below ~1e-38. Under tensor parallelism each rank's log-sum-exp is combined as
the log-prob op combines its partials (:func:`combine_rest`).

Its gradient (:func:`rest_grad_`), for ``log rest = log sum_{j outside} p_j``, is ``p_j (1/rest - 1)`` outside the
set and ``-p_j`` inside, each formed as one bounded product: ``exp(log p_j - log rest) (1 - rest)`` (with
``1 - rest = -expm1(log rest)``) outside, so neither ``1/rest`` overflows nor ``1/rest - 1`` cancels.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

NEG_BIG = -1.0e30  # the log-prob op's running-max start (its placeholders)
NO_LOGIT = -1.0e20  # below this a value is a placeholder or a padded vocabulary row's -1e30, never a real logit


def inside(shape: tuple[int, int], columns: torch.Tensor, hit: torch.Tensor) -> torch.Tensor:
    """[n, c] bool: the chunk columns that ``columns`` [n, R] names where ``hit`` holds. Counting hits (a
    scatter-add) lets a missed entry, clamped into the chunk, share a hit's column without undoing it."""
    counts = torch.zeros(shape, dtype=torch.int32, device=columns.device)
    return counts.scatter_add_(1, columns, hit.to(torch.int32)) > 0


class RunningLogSumExp:
    """``log sum exp(v)`` per row over the values fed to :meth:`add`, chunk by chunk, relative to its own running
    maximum (so a small term is not lost against a larger one elsewhere in the row)."""

    def __init__(self, rows: int, device: torch.device):
        self.m = torch.full((rows,), NEG_BIG, dtype=torch.float32, device=device)
        self.s = torch.zeros(rows, dtype=torch.float32, device=device)

    def add(self, values: torch.Tensor, keep: torch.Tensor) -> None:
        """Adds ``values`` [n, c] (fp32 logits) where ``keep`` [n, c] holds (placeholders and padding never)."""
        keep = keep & (values > NO_LOGIT)
        m_new = torch.maximum(self.m, torch.where(keep, values, NEG_BIG).amax(dim=1))
        terms = torch.where(keep, torch.exp(values - m_new[:, None]), 0.0)  # exp <= 1 where kept
        self.s = self.s * torch.exp(self.m - m_new) + terms.sum(dim=1)
        self.m = m_new

    def value(self) -> torch.Tensor:
        """The log-sum-exp [n]; -inf in a row where nothing was kept."""
        return torch.where(self.s > 0, self.m + torch.log(self.s), float("-inf"))


def combine_rest(local: torch.Tensor, logz: torch.Tensor, tp_group, tp_size: int,
                 common: torch.Tensor | None = None) -> torch.Tensor:
    """The rest's log-probability: every TP rank's log-sum-exp ``local`` [n] combined (max, then a sum of the
    rescaled terms), with ``common`` (a log-sum-exp every rank holds alike) added once, less ``logz``; -inf where
    nothing lies outside."""
    total = local
    if tp_size > 1:
        top = local.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
        top = torch.where(torch.isfinite(top), top, 0.0)
        summed = torch.exp(local - top)
        dist.all_reduce(summed, group=tp_group)
        total = torch.where(summed > 0, top + torch.log(summed), float("-inf"))
    if common is not None:
        total = torch.logaddexp(total, common)
    return total - logz


def rest_grad_(log_p: torch.Tensor, g_rest: torch.Tensor, log_rest: torch.Tensor, columns: torch.Tensor,
               hit: torch.Tensor) -> torch.Tensor:
    """``g_rest * d log(rest) / dl`` for one vocab chunk, written into its log-probs ``log_p`` [n, c] (module
    docstring); ``columns``/``hit`` [n, R] locate the set's ids in the chunk. Rows with nothing outside get 0."""
    finite = torch.isfinite(log_rest)
    log_rest = torch.where(finite, log_rest, 0.0)
    g_rest = torch.where(finite, g_rest, 0.0)
    held = inside(tuple(log_p.shape), columns, hit)
    log_p.add_(torch.where(held, 0.0, -log_rest[:, None])).exp_()  # p_j inside, p_j / rest outside
    factor = torch.where(held, -1.0, -torch.expm1(log_rest)[:, None])  # -1 inside, 1 - rest outside
    return log_p.mul_(factor).mul_(g_rest[:, None])
