"""Preference learning on the trainer's models: DPO-family steps, reward-model steps, reward scores.

A *pair batch* is an :class:`ExperienceBatch` whose rows are ``[chosen_0, rejected_0, chosen_1, ...]``
(prompt + response of each side), whose ``response_mask`` is the loss mask and whose ``group_ids`` are
the pairs' positions in the global batch. Its micro-batches keep the two rows of a pair together
(:func:`megarlhf.learner.packing.plan_micro_batches` groups), so every micro-batch computes whole pair
losses, and a data-parallel shard always holds whole pairs.

An unpaired loss (KTO) reads the same layout: its rows are ``[example_0, kl_row_0, example_1, ...]``
(:class:`megarlhf.data.preference.UnpairedExample`), with each example's label in ``desirable`` [P].

* :func:`preference_step`: one optimizer step of the actor on the registered preference loss
  (``preference.loss`` in :data:`megarlhf.algorithms.preference_losses.PREFERENCE_LOSSES`: DPO / cDPO,
  IPO, SimPO, KTO), fed each side's log-prob summed over its response tokens (temperature 1) and, for losses
  that need it, the reference model's (computed on the fly or precomputed: :func:`sequence_logprobs`).
  The step's loss is the mean over the pairs (unpaired: the examples) of the global batch (counted over
  every micro-batch and DP rank), metrics ``dpo/loss``, ``rewards/{chosen,rejected,accuracy,margin}``,
  ``logps/{chosen,rejected}`` (means over the global batch; unpaired: per label, no accuracy, and
  ``kto/kl``, the KL baseline), ``dpo/grad_norm``, ``dpo/lr``, ``dpo/skipped_steps``.
* :func:`kl_baseline`: KTO's ``z0`` from the KL rows, forward only, as TRL's ``KTOTrainer`` estimates it:
  the mean of ``log pi(y'|x) - log pi_ref(y'|x)`` over the mismatched rows, clamped at 0. TRL averages
  over each micro-batch on every process; here the mean runs over the whole global batch (every
  micro-batch and DP rank), which is TRL's number when its gradient accumulation is 1.
* :func:`reward_model_step`: one optimizer step of a value-head model on the Bradley-Terry loss of the
  scores at each side's last token (plus an optional constant margin); metrics ``rm/loss``,
  ``rm/accuracy``, ``rm/chosen_score``, ``rm/rejected_score``, ``rm/margin``, ``rm/grad_norm``, ...
* both also report ``train/shared_prefix_tokens_saved``: the tokens the pairs' shared prompts spared.
* :func:`compute_scores`: a value-head model's score of each sequence (its last token), forward only.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from megarlhf.algorithms.preference_losses import (PREFERENCE_LOSSES, PreferenceLossInputs, PreferenceLossOutput,
                                                   UnpairedLossInputs, bradley_terry_loss)
from megarlhf.config.schema import RunConfig
from megarlhf.data.preference import PreferencePair, UnpairedExample
from megarlhf.learner.batch import ExperienceBatch
from megarlhf.learner.forward import Outputs, forward_only
from megarlhf.learner.models import TrainModel
from megarlhf.learner.moe_metrics import mean_moe_metrics
from megarlhf.learner.step import PREFIX_TOKENS_SAVED, micro_batches_for, optimizer_step

RM_METRICS = ["rm/accuracy", "rm/chosen_score", "rm/rejected_score", "rm/margin"]


def pair_batch(pairs: Sequence[PreferencePair | UnpairedExample], device: torch.device, pad_id: int = 0,
               first_pair: int = 0) -> ExperienceBatch:
    """The pair batch of ``pairs`` (or unpaired examples and their KL rows) on ``device`` (group ids count
    from ``first_pair``)."""
    if not pairs:
        raise ValueError("pair_batch: no pairs")
    rows = [side for p in pairs for side in p.rows()]
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


def _summed(model: TrainModel, batch: ExperienceBatch, mbs) -> Tensor:
    lp = forward_only(model.model, mbs, tuple(batch.input_ids.shape), model.runtime,
                      Outputs("logprobs", model.vocab_size))["logprobs"]
    return torch.where(batch.response_mask, lp, lp.new_zeros(())).sum(dim=1)


def sequence_logprobs(model: TrainModel, batch: ExperienceBatch, config: RunConfig) -> Tensor:
    """Each row's log-prob summed over its response tokens [B] (forward only, temperature 1)."""
    return _summed(model, batch, _pair_micro_batches(batch, config, model.runtime))


def compute_scores(model: TrainModel, batch: ExperienceBatch, config: RunConfig) -> Tensor:
    """A value-head model's score of every row [B]: its output at the row's last token."""
    mbs = micro_batches_for(batch.input_ids, batch.lengths, batch.response_mask, config, model.runtime)
    return forward_only(model.model, mbs, tuple(batch.input_ids.shape), model.runtime,
                        Outputs("scores", model.vocab_size))["scores"]


def _global_pairs(batch: ExperienceBatch, runtime) -> float:
    return runtime.all_reduce([batch.batch_size // 2])[0]


COUNT = "#rows"  # suffix of the metric that counts the rows a loss metric's mean runs over


def _metric_sums(names, result, n: float) -> dict:
    """Each metric times the rows it is a mean over, and that count (summed over micro-batches and ranks)."""
    sums = {}
    for name in names:
        count = result.counts.get(name, n)
        sums[name], sums[name + COUNT] = result.metrics[name].detach() * count, count
    return sums


def _step_metrics(prefix: str, result, names, pairs: float) -> dict[str, float]:
    metrics = {f"{prefix}/loss": result.metrics["loss"] / result.metrics["pairs"],
               f"{prefix}/grad_norm": result.grad_norm if result.grad_norm is not None else float("nan"),
               f"{prefix}/lr": result.lr, f"{prefix}/skipped_steps": float(result.skipped)}
    for name in names:  # nan where no row of the global batch has the metric's label
        count = result.metrics.get(name + COUNT, pairs)
        metrics[name] = result.metrics[name] / count if count else float("nan")
    metrics["train/shared_prefix_tokens_saved"] = result.metrics[PREFIX_TOKENS_SAVED]
    return {**metrics, **mean_moe_metrics(prefix, [result.moe])}


def _metric_names(names) -> list[str]:
    return [key for name in names for key in (name, name + COUNT)]


def _pair_inputs(summed: Tensor, lengths: Tensor, ref: Tensor | None) -> PreferenceLossInputs:
    """The paired loss's inputs from per-row summed log-probs, response lengths and reference log-probs
    (None: reference-free), all [2P] in the pair layout ``[chosen_0, rejected_0, ...]``."""
    summed, lengths = summed.view(-1, 2), lengths.view(-1, 2)
    ref = None if ref is None else ref.view(-1, 2)
    return PreferenceLossInputs(chosen_logps=summed[:, 0], rejected_logps=summed[:, 1], chosen_lengths=lengths[:, 0],
                                rejected_lengths=lengths[:, 1], ref_chosen_logps=None if ref is None else ref[:, 0],
                                ref_rejected_logps=None if ref is None else ref[:, 1])


def preference_step(actor: TrainModel, batch: ExperienceBatch, config: RunConfig,
                    reference_logps: Tensor | None = None, *, desirable: Tensor | None = None,
                    on_nonfinite: str = "abort") -> dict[str, float]:
    """One optimizer step of ``actor`` on this DP rank's pair ``batch`` (see the module docstring);
    ``reference_logps`` [B]: the reference's summed log-probs of every row (None for reference-free
    losses); ``desirable`` [P]: the labels of an unpaired loss's examples. Returns metrics identical on
    every rank."""
    loss = PREFERENCE_LOSSES.get(config.preference.loss)
    if loss.needs_reference and reference_logps is None:
        raise ValueError(f"preference_step: preference.loss={config.preference.loss!r} needs the reference "
                         f"model's log-probs")
    if not loss.paired:
        return _unpaired_step(actor, batch, config, reference_logps, desirable, on_nonfinite)

    def inputs_of(rows, summed, lengths):
        return _pair_inputs(summed, lengths, None if reference_logps is None else reference_logps[rows])

    mbs = _pair_micro_batches(batch, config, actor.runtime)
    return _loss_step(actor, batch, mbs, config, _global_pairs(batch, actor.runtime), inputs_of, on_nonfinite)


def _loss_step(actor: TrainModel, rows_batch: ExperienceBatch, mbs, config: RunConfig, count: float, inputs_of,
               on_nonfinite: str) -> dict[str, float]:
    """One optimizer step of the registered preference loss over ``rows_batch``'s micro-batches ``mbs``:
    ``inputs_of(rows, summed, lengths)`` makes the loss's inputs of a micro-batch's rows; ``count`` is the
    global number of loss items (pairs or examples) the loss is averaged over."""
    loss = PREFERENCE_LOSSES.get(config.preference.loss)
    factor = float(actor.runtime.dp_cp.size)

    def loss_fn(mb, out):
        mask = rows_batch.response_mask[mb.rows, :mb.width]
        summed = torch.where(mask, out["logprobs"], out["logprobs"].new_zeros(())).sum(dim=1)
        result = loss(inputs_of(mb.rows, summed, mask.sum(dim=1)), config.preference.params)
        share = result.loss.sum() * (factor / count)
        n = float(result.loss.numel())  # device tensors: reduce_metric_sums reads them once per step
        return share, {"loss": result.loss.detach().sum(), "pairs": n, **_metric_sums(loss.metrics, result, n)}

    result = optimizer_step(actor, mbs, loss_fn, ["loss", "pairs", *_metric_names(loss.metrics)], loss_name="loss",
                            on_nonfinite=on_nonfinite)
    return _step_metrics("dpo", result, loss.metrics, count)


def _kl_mean(policy_kl: Tensor | None, ref_kl: Tensor | None, runtime) -> Tensor:
    """The clamped global mean of ``policy_kl - ref_kl`` over every DP rank's KL rows (None: this rank has
    none but takes part), as a float32 scalar on the runtime's device. Summed and reduced in float64 on the
    device: no host read before the step that uses it."""
    local = torch.zeros(2, dtype=torch.float64, device=runtime.device)  # (sum, rows)
    if policy_kl is not None:
        local[0] = (policy_kl.double() - ref_kl.double()).sum()
        local[1] = policy_kl.numel()
    total, count = runtime.all_reduce_on_device(local)
    return (total / count.clamp(min=1.0)).clamp(min=0.0).float()


def kl_baseline(model: TrainModel, batch: ExperienceBatch, config: RunConfig, reference_logps: Tensor) -> Tensor:
    """KTO's KL baseline ``z0`` for this step (module docstring): the policy scores the KL rows (the odd
    rows of ``batch``) forward only; ``reference_logps`` [B] holds the reference's scores of every row."""
    kl_rows = batch.select(range(1, batch.batch_size, 2))
    mbs = micro_batches_for(kl_rows.input_ids, kl_rows.lengths, kl_rows.response_mask, config, model.runtime)
    with torch.no_grad():
        policy = _summed(model, kl_rows, mbs)
    return _kl_mean(policy, reference_logps[1::2], model.runtime)


def _unpaired_step(actor: TrainModel, batch: ExperienceBatch, config: RunConfig, reference_logps: Tensor,
                   desirable: Tensor | None, on_nonfinite: str) -> dict[str, float]:
    """:func:`preference_step` of an unpaired loss: the KL baseline first, then the step on the examples."""
    if desirable is None or tuple(desirable.shape) != (batch.batch_size // 2,):
        raise ValueError(f"preference_step: preference.loss={config.preference.loss!r} reads unpaired rows and "
                         f"needs desirable [{batch.batch_size // 2}] (one label per example)")
    z0 = kl_baseline(actor, batch, config, reference_logps)
    examples, ref = batch.select(range(0, batch.batch_size, 2)), reference_logps[0::2]
    mbs = micro_batches_for(examples.input_ids, examples.lengths, examples.response_mask, config, actor.runtime)

    def inputs_of(rows, summed, lengths):
        return UnpairedLossInputs(logps=summed, lengths=lengths, desirable=desirable[rows], ref_logps=ref[rows],
                                  kl_baseline=z0)

    metrics = _loss_step(actor, examples, mbs, config, _global_pairs(batch, actor.runtime), inputs_of, on_nonfinite)
    return {**metrics, "kto/kl": float(z0)}


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
                   reference_logps: Tensor | None = None, desirable: Tensor | None = None) -> dict[str, float]:
    """Held-out metrics of this DP rank's pair ``batch`` (None: this rank has no held-out pair but takes
    part), as global means: a reward model's ``rm/*`` (scores), or a policy's preference-loss metrics
    (``dpo/loss``, ``rewards/*``, ``logps/*``; an unpaired loss also ``kto/kl`` and reads ``desirable``)."""
    if model.kind == "scores":
        names, prefix, loss = RM_METRICS, "rm", None
    else:
        loss = PREFERENCE_LOSSES.get(config.preference.loss)
        names, prefix = list(loss.metrics), "dpo"
    result, extra = None, {}
    with torch.no_grad():
        if model.kind == "scores":
            if batch is not None:
                scores = compute_scores(model, batch, config).view(-1, 2)
                result = _bradley_terry_output(scores)
        else:
            summed = None if batch is None else sequence_logprobs(model, batch, config)
            result, extra = _held_out_loss(loss, summed, batch, reference_logps, desirable, config, model.runtime)
    sums = [0.0] * (2 + 2 * len(names))  # rows, loss sum, (metric sum, rows) per metric
    if result is not None:
        n = float(result.loss.numel())
        sums[:2] = [n, float(result.loss.sum())]
        for i, name in enumerate(names):
            count = float(result.counts.get(name, n))
            sums[2 + 2 * i: 4 + 2 * i] = [float(result.metrics[name]) * count, count]
    sums = model.runtime.all_reduce(sums)
    metrics = {f"{prefix}/loss": sums[1] / max(sums[0], 1.0), f"{prefix}/pairs": sums[0], **extra}
    for i, name in enumerate(names):
        metrics[name] = sums[2 + 2 * i] / sums[3 + 2 * i] if sums[3 + 2 * i] else float("nan")
    return metrics


def _bradley_terry_output(scores: Tensor):
    loss, stats = bradley_terry_loss(scores[:, 0], scores[:, 1])
    return PreferenceLossOutput(loss=loss, metrics=stats)


def _held_out_loss(loss, summed: Tensor | None, batch: ExperienceBatch | None, reference_logps: Tensor | None,
                   desirable: Tensor | None, config: RunConfig, runtime):
    """(the loss output of this rank's held-out rows or None, extra metrics) from each row's summed
    log-prob; an unpaired loss first agrees on the KL baseline over every rank."""
    params = config.preference.params
    if not loss.paired:
        z0 = _kl_mean(None if summed is None else summed[1::2],
                      None if summed is None else reference_logps[1::2], runtime)
        if summed is None:
            return None, {"kto/kl": float(z0)}
        lengths = batch.response_mask[0::2].sum(dim=1)
        return loss(UnpairedLossInputs(logps=summed[0::2], lengths=lengths, desirable=desirable,
                                       ref_logps=reference_logps[0::2], kl_baseline=z0), params), {"kto/kl": float(z0)}
    if summed is None:
        return None, {}
    return loss(_pair_inputs(summed, batch.response_mask.sum(dim=1), reference_logps), params), {}
