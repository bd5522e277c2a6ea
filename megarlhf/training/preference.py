"""Preference learning on the trainer's models: DPO-family steps, reward-model steps, reward scores.

A *pair batch* is an :class:`ExperienceBatch` whose rows are ``[chosen_0, rejected_0, chosen_1, ...]``
(prompt + response of each side), whose ``response_mask`` is the loss mask and whose ``group_ids`` are
the pairs' positions in the global batch. Its micro-batches keep the two rows of a pair together
(:func:`megarlhf.training.packing.plan_micro_batches` groups), so every micro-batch computes whole pair
losses, and a data-parallel shard always holds whole pairs.

* :func:`preference_step`: one optimizer step of the actor on the registered preference loss
  (``preference.loss`` in :data:`megarlhf.algorithms.preference_losses.PREFERENCE_LOSSES`: DPO / cDPO,
  IPO, SimPO), fed each side's log-prob summed over its response tokens (temperature 1) and, for losses
  that need it, the reference model's (computed on the fly or precomputed: :func:`sequence_logprobs`).
  The step's loss is the mean over the pairs of the global batch (counted over every micro-batch and DP
  rank), metrics ``dpo/loss``, ``rewards/{chosen,rejected,accuracy,margin}``, ``logps/{chosen,rejected}``
  (means over the global batch), ``dpo/grad_norm``, ``dpo/lr``, ``dpo/skipped_steps``.
* :func:`reward_model_step`: one optimizer step of a value-head model on the Bradley-Terry loss of the
  scores at each side's last token (plus an optional constant margin); metrics ``rm/loss``,
  ``rm/accuracy``, ``rm/chosen_score``, ``rm/rejected_score``, ``rm/margin``, ``rm/grad_norm``, ...
* both also report ``train/shared_prefix_tokens_saved``: the tokens the pairs' shared prompts spared.
* :func:`compute_scores`: a value-head model's score of each sequence (its last token), forward only.

Hand-written because it is the project's composition of the registered losses and Megatron's step.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from megarlhf.algorithms.preference_losses import (PREFERENCE_LOSSES, PreferenceLossInputs,
                                                   bradley_terry_loss)
from megarlhf.config.schema import RunConfig
from megarlhf.data.preference import PreferencePair
from megarlhf.training.batch import ExperienceBatch
from megarlhf.training.forward import forward_only
from megarlhf.training.models import TrainModel
from megarlhf.training.step import PREFIX_TOKENS_SAVED, micro_batches_for, optimizer_step

PREFERENCE_METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin",
                      "logps/chosen", "logps/rejected"]
RM_METRICS = ["rm/accuracy", "rm/chosen_score", "rm/rejected_score", "rm/margin"]


def pair_batch(pairs: Sequence[PreferencePair], device: torch.device, pad_id: int = 0,
               first_pair: int = 0) -> ExperienceBatch:
    """The pair batch of ``pairs`` on ``device`` (group ids count from ``first_pair``)."""
    if not pairs:
        raise ValueError("pair_batch: no pairs")
    rows = [side for p in pairs for side in ((p.chosen_ids, p.chosen_mask), (p.rejected_ids, p.rejected_mask))]
    width = max(len(ids) for ids, _ in rows)
    ids = [list(i) + [pad_id] * (width - len(i)) for i, _ in rows]
    mask = [[bool(m) for m in mk] + [False] * (width - len(mk)) for _, mk in rows]
    return ExperienceBatch(torch.tensor(ids, dtype=torch.long, device=device),
                           torch.tensor([len(i) for i, _ in rows], dtype=torch.long, device=device),
                           torch.tensor(mask, dtype=torch.bool, device=device),
                           group_ids=torch.arange(first_pair, first_pair + len(pairs), device=device
                                                  ).repeat_interleave(2))


def _pairs_of(num_rows: int) -> list[list[int]]:
    return [[r, r + 1] for r in range(0, num_rows, 2)]


def _pair_micro_batches(batch: ExperienceBatch, config: RunConfig, runtime):
    return micro_batches_for(batch.input_ids, batch.lengths, batch.response_mask, config, runtime,
                             groups=_pairs_of(batch.batch_size))


def sequence_logprobs(model: TrainModel, batch: ExperienceBatch, config: RunConfig) -> Tensor:
    """Each row's log-prob summed over its response tokens [B] (forward only, temperature 1)."""
    mbs = _pair_micro_batches(batch, config, model.runtime)
    lp = forward_only(model.model, mbs, tuple(batch.input_ids.shape), model.runtime, kind="logprobs",
                      vocab_size=model.vocab_size)["logprobs"]
    return torch.where(batch.response_mask, lp, lp.new_zeros(())).sum(dim=1)


def compute_scores(model: TrainModel, batch: ExperienceBatch, config: RunConfig) -> Tensor:
    """A value-head model's score of every row [B]: its output at the row's last token."""
    mbs = micro_batches_for(batch.input_ids, batch.lengths, batch.response_mask, config, model.runtime)
    return forward_only(model.model, mbs, tuple(batch.input_ids.shape), model.runtime, kind="scores",
                        vocab_size=model.vocab_size)["scores"]


def _global_pairs(batch: ExperienceBatch, runtime) -> float:
    return runtime.all_reduce([batch.batch_size // 2])[0]


def _step_metrics(prefix: str, result, names: list[str], pairs: float) -> dict[str, float]:
    metrics = {f"{prefix}/loss": result.metrics["loss"] / result.metrics["pairs"],
               f"{prefix}/grad_norm": result.grad_norm if result.grad_norm is not None else float("nan"),
               f"{prefix}/lr": result.lr, f"{prefix}/skipped_steps": float(result.skipped)}
    metrics.update({name: result.metrics[name] / pairs for name in names})
    metrics["train/shared_prefix_tokens_saved"] = result.metrics[PREFIX_TOKENS_SAVED]
    return metrics


def preference_step(actor: TrainModel, batch: ExperienceBatch, config: RunConfig,
                    reference_logps: Tensor | None = None, *, on_nonfinite: str = "abort") -> dict[str, float]:
    """One optimizer step of ``actor`` on this DP rank's pair ``batch`` (see the module docstring);
    ``reference_logps`` [B]: the reference's summed log-probs of every row (None for reference-free
    losses). Returns metrics identical on every rank."""
    loss = PREFERENCE_LOSSES.get(config.preference.loss)
    if loss.needs_reference and reference_logps is None:
        raise ValueError(f"preference_step: preference.loss={config.preference.loss!r} needs the reference "
                         f"model's log-probs")
    runtime = actor.runtime
    pairs = _global_pairs(batch, runtime)
    factor = float(runtime.dp_cp.size)

    def loss_fn(mb, out):
        rows, width = mb.rows, mb.width
        mask = batch.response_mask[rows, :width]
        summed = torch.where(mask, out["logprobs"], out["logprobs"].new_zeros(())).sum(dim=1).view(-1, 2)
        lengths = mask.sum(dim=1).view(-1, 2)
        ref = None if reference_logps is None else reference_logps[rows].view(-1, 2)
        result = loss(PreferenceLossInputs(
            chosen_logps=summed[:, 0], rejected_logps=summed[:, 1], chosen_lengths=lengths[:, 0],
            rejected_lengths=lengths[:, 1], ref_chosen_logps=None if ref is None else ref[:, 0],
            ref_rejected_logps=None if ref is None else ref[:, 1]), config.preference.params)
        share = result.loss.sum() * (factor / pairs)
        n = float(result.loss.numel())  # device tensors: reduce_metric_sums reads them once per step
        metrics = {"loss": result.loss.detach().sum(), "pairs": n,
                   **{name: result.metrics[name].detach() * n for name in PREFERENCE_METRICS}}
        return share, metrics

    result = optimizer_step(actor, _pair_micro_batches(batch, config, runtime), loss_fn,
                            ["loss", "pairs", *PREFERENCE_METRICS], loss_name="loss", on_nonfinite=on_nonfinite)
    return _step_metrics("dpo", result, PREFERENCE_METRICS, pairs)


def reward_model_step(model: TrainModel, batch: ExperienceBatch, config: RunConfig, *,
                      on_nonfinite: str = "abort") -> dict[str, float]:
    """One optimizer step of a value-head ``model`` on the Bradley-Terry loss of this DP rank's pairs."""
    runtime = model.runtime
    pairs = _global_pairs(batch, runtime)
    factor = float(runtime.dp_cp.size)
    margin = config.preference.rm_margin

    def loss_fn(mb, out):
        scores = out["scores"].view(-1, 2)
        margins = None if not margin else torch.full_like(scores[:, 0], margin)
        loss, stats = bradley_terry_loss(scores[:, 0], scores[:, 1], margins)
        share = loss.sum() * (factor / pairs)
        n = float(loss.numel())  # device tensors: reduce_metric_sums reads them once per step
        return share, {"loss": loss.detach().sum(), "pairs": n,
                       **{name: stats[name].detach() * n for name in RM_METRICS}}

    result = optimizer_step(model, _pair_micro_batches(batch, config, runtime), loss_fn,
                            ["loss", "pairs", *RM_METRICS], loss_name="loss", on_nonfinite=on_nonfinite)
    return _step_metrics("rm", result, RM_METRICS, pairs)


def evaluate_pairs(model: TrainModel, batch: ExperienceBatch | None, config: RunConfig,
                   reference_logps: Tensor | None = None) -> dict[str, float]:
    """Held-out metrics of this DP rank's pair ``batch`` (None: this rank has no held-out pair but takes
    part), as global means: a reward model's ``rm/*`` (scores), or a policy's preference-loss metrics
    (``dpo/loss``, ``rewards/*``, ``logps/*``)."""
    names, prefix = (RM_METRICS, "rm") if model.kind == "scores" else (PREFERENCE_METRICS, "dpo")
    sums = [0.0] * (2 + len(names))  # pairs, loss sum, metric sums
    if batch is not None:
        with torch.no_grad():
            if model.kind == "scores":
                scores = compute_scores(model, batch, config).view(-1, 2)
                loss, stats = bradley_terry_loss(scores[:, 0], scores[:, 1])
            else:
                summed = sequence_logprobs(model, batch, config).view(-1, 2)
                lengths = batch.response_mask.sum(dim=1).view(-1, 2)
                ref = None if reference_logps is None else reference_logps.view(-1, 2)
                result = PREFERENCE_LOSSES.get(config.preference.loss)(PreferenceLossInputs(
                    chosen_logps=summed[:, 0], rejected_logps=summed[:, 1], chosen_lengths=lengths[:, 0],
                    rejected_lengths=lengths[:, 1], ref_chosen_logps=None if ref is None else ref[:, 0],
                    ref_rejected_logps=None if ref is None else ref[:, 1]), config.preference.params)
                loss, stats = result.loss, result.metrics
        n = loss.numel()
        sums = [float(n), float(loss.sum())] + [float(stats[name]) * n for name in names]
    sums = model.runtime.all_reduce(sums)
    pairs = max(sums[0], 1.0)
    return {f"{prefix}/loss": sums[1] / pairs, **{name: sums[2 + i] / pairs for i, name in enumerate(names)},
            f"{prefix}/pairs": sums[0]}
