"""One optimizer step over a list of micro-batches, with the non-finite gate, and metric reduction.

:func:`optimizer_step` zeroes the gradient buffers, runs forward + backward of every micro-batch through
:func:`megarlhf.learner.forward.run_schedule` (DDP then averages gradients over data-parallel x
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
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megarlhf.algorithms import LossNormaliser, compute_normaliser
from megarlhf.learner.forward import LossFn, Outputs, run_schedule
from megarlhf.learner.models import TrainModel
from megarlhf.learner.packing import MicroBatch, Packing, build_micro_batches
from model_providers.base import shared_prefix_supported
from parallel.runtime import Runtime

NONFINITE_MODES = ("abort", "skip")
# every OptimizerStepResult's metrics also hold this: the tokens shared prompt prefixes spared the step's forwards
PREFIX_TOKENS_SAVED = "prefix_tokens_saved"


class NonFiniteError(FloatingPointError):
    """A training step produced a non-finite loss or gradient; no optimizer step was taken."""


@dataclass
class OptimizerStepResult:
    """What one optimizer step did (not :class:`megarlhf.envs.api.StepResult`, an environment's turn)."""

    metrics: dict[str, float]  # the loss_fn metrics (and PREFIX_TOKENS_SAVED), summed over micro-batches, DP ranks
    grad_norm: float | None  # global gradient norm before clipping (None when skipped)
    lr: float  # the learning rate of this step
    skipped: bool
    reason: str = ""  # why it was skipped
    moe: dict[str, float] = dataclasses.field(default_factory=dict)  # routing metrics of an MoE model (moe_metrics)


def reduce_metric_sums(per_micro_batch: list[dict], names: list[str], runtime: Runtime) -> dict[str, float]:
    """Sums ``names`` over the micro-batches of the last pipeline stage and over the data-parallel
    group; every rank gets the result. A metric may be a device tensor (0-dim) or a number: the sums
    stay on the device until the one host read at the end."""
    columns, host, numbers = [[] for _ in names], [0.0] * len(names), False
    for metrics in per_micro_batch if runtime.is_last_stage else ():
        for index, name in enumerate(names):
            value = metrics[name]
            if isinstance(value, torch.Tensor):
                columns[index].append(value.double().reshape(()))
            else:
                host[index], numbers = host[index] + float(value), True
    zero = torch.zeros((), dtype=torch.float64, device=runtime.device)
    sums = torch.stack([torch.stack(column).sum() if column else zero for column in columns])
    if numbers:  # metrics known on the host: one copy to the device per pass, not one per micro-batch
        sums += torch.tensor(host, dtype=torch.float64, device=runtime.device)
    runtime.all_reduce_on_device(sums, over="dp")
    if runtime.pp.size > 1:  # the other stages hold zeros: the last stage's sums reach them
        runtime.all_reduce_on_device(sums, over="pp")
    return dict(zip(names, sums.tolist()))  # host: the one read of the step's metrics


def _nonfinite(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(parameters, gradients): names (this rank's stage) holding a non-finite element. The checks run on
    the device and are read in one transfer: one host synchronisation per step, not two per parameter.
    Frozen parameters (LoRA's base) are not checked: no step changes them."""
    names, finite = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        grad = getattr(param, "main_grad", None)
        if grad is None:
            grad = param.grad
        names.append(name.removeprefix("module."))
        finite += [torch.isfinite(param).all(),
                   torch.isfinite(grad).all() if grad is not None else torch.ones((), dtype=torch.bool,
                                                                                  device=param.device)]
    if not names:
        return [], []
    flags = torch.stack(finite).view(-1, 2).tolist()  # host: the verdict is taken there
    return ([n for n, (p, _) in zip(names, flags) if not p], [n for n, (_, g) in zip(names, flags) if not g])


def _names(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _nonfinite_reason(role: str, loss_name: str, loss: float, params: list[str], grads: list[str],
                      rank: int) -> str:
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


def _grad_norm(trainable: TrainModel, norm_from_step) -> float:
    if norm_from_step is not None:
        return float(norm_from_step)
    return float(trainable.optimizer.get_grad_norm())


def _zero_grads(trainable: TrainModel) -> None:
    trainable.model.zero_grad_buffer()
    trainable.optimizer.zero_grad()


def optimizer_step(trainable: TrainModel, micro_batches: list[MicroBatch], loss_fn: LossFn,
                   metric_names: list[str], *, loss_name: str, outputs: Outputs | None = None,
                   on_nonfinite: str = "abort") -> OptimizerStepResult:
    """Forward + backward of ``micro_batches``, the non-finite gate, then one optimizer step.

    ``loss_fn(mb, outputs) -> (share, metrics)`` with ``metrics`` holding every name of
    ``metric_names`` (sums over the micro-batch, divided by the DP factor where they are loss shares);
    ``loss_name`` is the metric that must be finite. ``outputs``: what the forward computes (default: the
    model's kind at temperature 1, no entropy; :class:`~megarlhf.learner.forward.Outputs`).
    """
    if on_nonfinite not in NONFINITE_MODES:
        raise ValueError(f"on_nonfinite must be one of {NONFINITE_MODES}, got {on_nonfinite!r}")
    if not trainable.trainable:
        raise ValueError(f"optimizer_step: the {trainable.role} model has no optimizer")
    _zero_grads(trainable)
    trainable.model.train()
    runtime = trainable.runtime
    if trainable.router_stats is not None:
        trainable.router_stats.reset()

    def counted(mb, outputs):  # host integers, summed and reduced with the loss_fn's metrics
        share, metrics = loss_fn(mb, outputs)
        return share, {**metrics, PREFIX_TOKENS_SAVED: float(tokens_saved_by_sharing([mb]))}

    replay = trainable.routing_replay
    if replay is not None:
        replay.reset_counts()
    outputs = outputs or Outputs(trainable.kind, trainable.vocab_size)
    per_mb = run_schedule(trainable.model, micro_batches, runtime, outputs, loss_fn=counted, replay=replay)
    metrics = reduce_metric_sums(per_mb, [*metric_names, PREFIX_TOKENS_SAVED], runtime)
    moe = {} if trainable.router_stats is None else trainable.router_stats.step_metrics(runtime, len(micro_batches))
    if replay is not None:  # the update's own routing against the routing it replays
        moe.update(replay.mismatch_metrics(runtime, "moe/routing_"))
    lr = float(trainable.optimizer.param_groups[0]["lr"])
    bad_params, bad_grads = _nonfinite(trainable.model)
    loss = metrics[loss_name]
    if runtime.any_rank(not math.isfinite(loss) or bool(bad_params) or bool(bad_grads)):
        reason = _nonfinite_reason(trainable.role, loss_name, loss, bad_params, bad_grads, runtime.launch.rank)
        _zero_grads(trainable)
        if on_nonfinite == "abort":
            raise NonFiniteError(f"{trainable.role} update: {reason}")
        return OptimizerStepResult(metrics, None, lr, skipped=True, reason=reason, moe=moe)
    success, norm, _ = trainable.optimizer.step()
    if not success:
        raise NonFiniteError(f"{trainable.role} update: Megatron's optimizer reported an overflow")
    grad_norm = _grad_norm(trainable, norm)
    trainable.scheduler.step(increment=1)
    return OptimizerStepResult(metrics, grad_norm, lr, skipped=False, moe=moe)


def skipped_step(trainable: TrainModel, metric_names: list[str], reason: str) -> OptimizerStepResult:
    """A step that is not taken (nothing to train on): no forward, no optimizer or scheduler step."""
    return OptimizerStepResult({name: 0.0 for name in [*metric_names, PREFIX_TOKENS_SAVED]}, None,
                      float(trainable.optimizer.param_groups[0]["lr"]), skipped=True, reason=reason)


def loss_normaliser(mask: Tensor, runtime: Runtime, max_response_length: int | None = None) -> LossNormaliser:
    """The step's global counts over this rank's ``mask`` [B, L] and the data-parallel group (every CP
    rank holds whole sequences, so CP ranks are not counted twice), with the gradient-average factor of
    DDP's group (dp x cp)."""
    normaliser = compute_normaliser([mask], runtime.dp.group, max_response_length=max_response_length)
    return dataclasses.replace(normaliser, grad_average_factor=runtime.dp_cp.size)


def prefix_sharing_off_reason(config, runtime: Runtime) -> str | None:
    """Why shared prompt prefixes are off although ``train.share_prompt_prefix`` asks for them (None: they
    are on, or not asked for)."""
    if not config.train.share_prompt_prefix:
        return None
    if not config.train.packing:
        return "train.packing=false (shared prefixes live in packed rows)"
    if runtime.cp.size != 1:
        return f"context_parallel_size={runtime.cp.size} (shared prefixes need 1)"
    if not shared_prefix_supported():
        return "Transformer Engine's attention is in use and cannot take a prefix mask"
    return None


def prefix_sharing_notice(config, runtime: Runtime) -> str | None:
    """The start-up line of a run whose shared prompt prefixes are off against the config (None: nothing
    to say), so that nobody reads whole-sequence numbers as shared-prefix ones."""
    reason = prefix_sharing_off_reason(config, runtime)
    if reason is None:
        return None
    return (f"train.share_prompt_prefix=true, but prompts are computed once per sample, not once per group: "
            f"{reason}; train/shared_prefix_tokens_saved stays 0")


def tokens_saved_by_sharing(micro_batches: list[MicroBatch]) -> int:
    """Tokens the shared prefixes of ``micro_batches`` spare the model (host integers: no device read)."""
    return sum(sum(mb.host_lengths) - mb.num_tokens for mb in micro_batches)


def micro_batches_for(batch_ids: Tensor, lengths: Tensor, wanted: Tensor, config, runtime: Runtime,
                      groups=None, routing: Tensor | None = None) -> list[MicroBatch]:
    """This CP rank's micro-batches of a (mini-)batch under ``config.train``'s budget and packing
    (``groups`` of rows kept in one micro-batch, e.g. preference pairs), with shared prompt prefixes where
    ``train.share_prompt_prefix`` asks and the layout allows (packed, CP = 1, megarlhf's attention:
    :func:`prefix_sharing_off_reason`)."""
    share = config.train.share_prompt_prefix and prefix_sharing_off_reason(config, runtime) is None
    # under TP every row is a multiple of TP tokens (per CP rank), which sequence parallelism (MoE models at
    # TP > 1) splits over the TP ranks; a dense model just computes those few padding tokens
    packing = Packing(config.train.micro_batch_tokens, config.train.packing, runtime.cp.size, runtime.cp.rank,
                      runtime.cp.group, share_prefixes=share, sequence_multiple=runtime.tp.size)
    return build_micro_batches(batch_ids, lengths, wanted, packing, groups=groups, routing=routing)
