"""One optimizer step over a list of micro-batches, with the non-finite gate, and metric reduction.

:func:`optimizer_step` zeroes the gradient buffers, runs forward + backward of every micro-batch through
:func:`megarlhf.training.forward.run_schedule` (DDP then averages gradients over data-parallel x
context-parallel ranks), reduces the micro-batches' metric sums over data-parallel ranks and pipeline
stages, and then gates the update:

* the summed loss must be finite, and every gradient element must be finite (checked on every rank,
  agreed over all ranks with one all-reduce);
* if not, ``on_nonfinite="abort"`` raises :class:`NonFiniteError` naming what was non-finite: the
  loss, the parameters holding non-finite values, the parameters with non-finite gradients (this
  rank's names); ``"skip"`` zeroes the gradients, takes no optimizer and no scheduler step (parameters,
  optimizer state and lr are untouched) and reports ``skipped=True``.

Otherwise Megatron's optimizer steps (clipping at ``optim.clip_grad``) and the lr scheduler advances.

Loss scaling contract for the ``loss_fn`` of the callers: the share of a micro-batch is its part of the
global loss times the size of the data-parallel x context-parallel group, the group DDP averages
gradients over (:func:`loss_normaliser` + :func:`megarlhf.algorithms.aggregate_loss`), computed on the
full (CP-unsharded) token-aligned outputs. Under context parallelism every CP rank computes that same
share; :func:`parallel.context_parallel.unshard` gives each rank the gradient of its own tokens only,
so the CP ranks' parameter gradients sum to the share's gradient, and DDP's average over dp x cp
leaves exactly the global loss's gradient.

Hand-written because the gate and the step bookkeeping are the project's own policy around Megatron.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megarlhf.algorithms import LossNormaliser, compute_normaliser
from megarlhf.training.forward import LossFn, broadcast_from_last_stage, run_schedule
from megarlhf.training.models import TrainModel
from megarlhf.training.packing import MicroBatch

NONFINITE_MODES = ("abort", "skip")


class NonFiniteError(FloatingPointError):
    """A training step produced a non-finite loss or gradient; no optimizer step was taken."""


@dataclass
class StepResult:
    metrics: dict[str, float]  # the loss_fn metrics, summed over micro-batches and DP ranks
    grad_norm: float | None  # global gradient norm before clipping (None when skipped)
    lr: float  # the learning rate of this step
    skipped: bool
    reason: str = ""  # why it was skipped


def reduce_metric_sums(per_micro_batch: list[dict], names: list[str], dp_group) -> dict[str, float]:
    """Sums ``names`` over the micro-batches of the last pipeline stage and over ``dp_group``; every rank
    gets the result."""
    from megatron.core import parallel_state as ps

    sums = torch.zeros(len(names), dtype=torch.float64)
    if ps.is_pipeline_last_stage():
        for metrics in per_micro_batch:
            sums += torch.tensor([float(metrics[name]) for name in names], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(sums, group=dp_group)
    broadcast_from_last_stage(sums)
    return dict(zip(names, sums.tolist()))


def _nonfinite(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(parameters, gradients): names (this rank's stage) holding a non-finite element."""
    params, grads = [], []
    for name, param in model.named_parameters():
        name = name.removeprefix("module.")
        if not bool(torch.isfinite(param).all()):
            params.append(name)
        grad = getattr(param, "main_grad", None)
        if grad is None:
            grad = param.grad
        if grad is not None and not bool(torch.isfinite(grad).all()):
            grads.append(name)
    return params, grads


def _names(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _nonfinite_reason(role: str, loss_name: str, loss: float, params: list[str], grads: list[str]) -> str:
    rank = dist.get_rank() if dist.is_initialized() else 0
    what = []
    if not math.isfinite(loss):
        what.append(f"the {role} loss is non-finite ({loss_name} = {loss})")
    if params:
        what.append(f"parameters hold non-finite values on rank {rank}: {_names(params)}")
    if grads:
        what.append(f"gradients are non-finite on rank {rank}: {_names(grads)}")
    if not what:
        what.append("another rank found non-finite gradients or parameters")
    return "; ".join(what) + "; no optimizer step was taken"


def _any_rank(flag: bool) -> bool:
    value = torch.tensor([1.0 if flag else 0.0])
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def _grad_norm(trainable: TrainModel, norm_from_step) -> float:
    if norm_from_step is not None:
        return float(norm_from_step)
    return float(trainable.optimizer.get_grad_norm())


def _zero_grads(trainable: TrainModel) -> None:
    trainable.model.zero_grad_buffer()
    trainable.optimizer.zero_grad()


def optimizer_step(trainable: TrainModel, micro_batches: list[MicroBatch], loss_fn: LossFn,
                   metric_names: list[str], *, loss_name: str, temperature: float = 1.0, entropy: bool = False,
                   on_nonfinite: str = "abort") -> StepResult:
    """Forward + backward of ``micro_batches``, the non-finite gate, then one optimizer step.

    ``loss_fn(mb, outputs) -> (share, metrics)`` with ``metrics`` holding every name of
    ``metric_names`` (sums over the micro-batch, divided by the DP factor where they are loss shares);
    ``loss_name`` is the metric that must be finite.
    """
    from megatron.core import parallel_state as ps

    if on_nonfinite not in NONFINITE_MODES:
        raise ValueError(f"on_nonfinite must be one of {NONFINITE_MODES}, got {on_nonfinite!r}")
    if not trainable.trainable:
        raise ValueError(f"optimizer_step: the {trainable.role} model has no optimizer")
    _zero_grads(trainable)
    trainable.model.train()
    per_mb = run_schedule(trainable.model, micro_batches, kind=trainable.kind, vocab_size=trainable.vocab_size,
                          temperature=temperature, entropy=entropy, loss_fn=loss_fn)
    metrics = reduce_metric_sums(per_mb, metric_names, ps.get_data_parallel_group())
    lr = float(trainable.optimizer.param_groups[0]["lr"])
    bad_params, bad_grads = _nonfinite(trainable.model)
    loss = metrics[loss_name]
    if _any_rank(not math.isfinite(loss) or bool(bad_params) or bool(bad_grads)):
        reason = _nonfinite_reason(trainable.role, loss_name, loss, bad_params, bad_grads)
        _zero_grads(trainable)
        if on_nonfinite == "abort":
            raise NonFiniteError(f"{trainable.role} update: {reason}")
        return StepResult(metrics, None, lr, skipped=True, reason=reason)
    success, norm, _ = trainable.optimizer.step()
    if not success:
        raise NonFiniteError(f"{trainable.role} update: Megatron's optimizer reported an overflow")
    grad_norm = _grad_norm(trainable, norm)
    trainable.scheduler.step(increment=1)
    return StepResult(metrics, grad_norm, lr, skipped=False)


def dp_group():
    """Megatron's pure data-parallel group (no CP), or None when it has one rank."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group() if dist.is_initialized() and ps.get_data_parallel_world_size() > 1 else None


def loss_normaliser(mask: Tensor, max_response_length: int | None = None) -> LossNormaliser:
    """The step's global counts over this rank's ``mask`` [B, L] and the data-parallel group (every CP
    rank holds whole sequences, so CP ranks are not counted twice), with the gradient-average factor of
    DDP's group (dp x cp)."""
    from megatron.core import parallel_state as ps

    normaliser = compute_normaliser([mask], dp_group(), max_response_length=max_response_length)
    factor = ps.get_data_parallel_world_size(with_context_parallel=True) if dist.is_initialized() else 1
    return dataclasses.replace(normaliser, grad_average_factor=factor)


def micro_batches_for(batch_ids: Tensor, lengths: Tensor, wanted: Tensor, config) -> list[MicroBatch]:
    """This CP rank's micro-batches of a (mini-)batch under ``config.train``'s budget and packing."""
    from megatron.core import parallel_state as ps

    from megarlhf.training.packing import build_micro_batches

    cp = ps.get_context_parallel_world_size()
    return build_micro_batches(batch_ids, lengths, wanted, config.train.micro_batch_tokens,
                               packed=config.train.packing, cp_size=cp,
                               cp_rank=ps.get_context_parallel_rank(),
                               cp_group=ps.get_context_parallel_group() if cp > 1 else None)
