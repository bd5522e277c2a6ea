"""Scoring and the RL update steps: actor and critic, over mini-batches and epochs.

* :func:`compute_logprobs` / :func:`compute_values`: forward-only per-token log-probs (actor, reference)
  and values (critic) of an :class:`ExperienceBatch`, [B, L] token-aligned, at the response tokens.
* :func:`actor_update`: the experience (this DP rank's share) is split into ``train.mini_batches``
  contiguous mini-batches, passed over ``train.epochs_per_step`` times; each mini-batch is one optimizer
  step whose per-token loss is

      policy_loss(name = algorithm.policy_loss)  [x TIS weights]
      + kl_loss(logprobs, ref_logprobs)           if algorithm.kl_in_loss (mode "loss" and kl.coef > 0)
      - entropy_coef * entropy                     if algorithm.entropy_coef != 0
      + distill.coef * distillation term           if algorithm.distill's term enters the loss (GKD)

  aggregated in ``algorithm.loss_aggregation`` with the mini-batch's global normaliser (counts over all
  micro-batches and DP ranks). Rollout/trainer mismatch correction (``algorithm.mismatch``: truncated
  IS weights and/or gap masking) compares the trainer's ``old_logprobs`` with ``rollout_logprobs`` once,
  before the first step, when the batch has rollout log-probs.

  Without ``old_logprobs`` (allowed when :func:`old_logprobs_from_update` holds: one optimizer step, no
  gap masking, no KL in the reward) the update's own forward supplies them, detached: the policy
  that forward runs is the one before the step, so these are the numbers a separate scoring pass would
  give, one forward fewer. The ``mismatch/*`` metrics then compare that forward with the rollout.
* :func:`critic_update`: the PPO value loss (clipped at ``algorithm.value_clip``) with the same
  mini-batch / epoch / aggregation scheme.

Metrics (means over the optimizer steps of the call; token-level ones are global token means):
``actor/pg_loss`` (the aggregated policy loss), ``actor/loss`` (everything), ``actor/kl_loss``,
``actor/ppo_kl``, ``actor/clip_fraction``, ``actor/entropy``, ``actor/grad_norm``, ``actor/lr`` (of
the last step), ``actor/skipped_steps``, and the ``mismatch/*`` metrics; ``critic/value_loss``,
``critic/value_clip_fraction``, ``critic/grad_norm``, ``critic/lr``, ``critic/skipped_steps``;
``train/shared_prefix_tokens_saved``: the tokens shared prompt prefixes spared the actor's training
forwards of the call (all optimizer steps, all DP ranks; 0 when sharing is off).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from megarlhf.algorithms import (POLICY_LOSSES, PolicyLossInputs, aggregate_loss, entropy_bonus,
                                 kl_loss, rollout_correction, truncated_is_weights, value_loss)
from megarlhf.algorithms.distillation import DistillInputs, DistillTerm, distills_into
from megarlhf.config.schema import RunConfig
from megarlhf.core.errors import ConfigError
from megarlhf.config.rollout import scoring_temperature
from megarlhf.learner.batch import ExperienceBatch
from megarlhf.learner.forward import Outputs, forward_only
from megarlhf.learner.models import TrainModel
from megarlhf.learner.moe_metrics import mean_moe_metrics
from megarlhf.learner.step import (PREFIX_TOKENS_SAVED, OptimizerStepResult, loss_normaliser, micro_batches_for,
                                    optimizer_step, skipped_step)
from parallel.runtime import Runtime

ACTOR_SUMS = ["loss", "pg_loss", "kl_loss", "tokens", "clip_fraction", "ppo_kl", "entropy"]
# every response token of the mini-batch is masked out (e.g. DAPO groups with equal rewards, or gap masking)
NOTHING_TO_TRAIN = "no response token to train on in this mini-batch on any rank"
CRITIC_SUMS = ["value_loss", "tokens", "value_clip_fraction"]


def compute_logprobs(model: TrainModel, batch: ExperienceBatch, config: RunConfig, entropy: bool = False,
                     temperature: float | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probs [B, L] of ``batch``'s response tokens under ``model`` (and entropies if asked), at the
    rollout's scoring temperature (:func:`megarlhf.config.rollout.scoring_temperature`) unless
    ``temperature`` is given. An actor with routing replay replays ``batch.routed_experts`` when the batch
    has them."""
    out = _logprob_pass(model, batch, config, entropy, temperature)
    return (out["logprobs"], out["entropy"]) if entropy else out["logprobs"]


def _logprob_pass(model: TrainModel, batch: ExperienceBatch, config: RunConfig, entropy: bool = False,
                  temperature: float | None = None, record_routing: bool = False) -> dict[str, Tensor]:
    temperature = scoring_temperature(config.rollout) if temperature is None else temperature
    replay = model.routing_replay
    mbs = micro_batches_for(batch.input_ids, batch.lengths, batch.response_mask, config, model.runtime,
                            routing=batch.routed_experts if replay is not None else None)
    out = forward_only(model.model, mbs, tuple(batch.input_ids.shape), model.runtime,
                       Outputs("logprobs", model.vocab_size, temperature, entropy, backend=logprob_backend(config)),
                       replay=replay, record_routing=record_routing)
    if record_routing:
        out["routing"] = replay.take_recorded(mbs, tuple(batch.input_ids.shape), model.provider.top_k)
    return out


def old_policy_logprobs(actor: TrainModel, batch: ExperienceBatch, config: RunConfig
                        ) -> tuple[ExperienceBatch, dict[str, float]]:
    """``batch`` with the actor's old log-probs and, under routing replay r2, the routing the actor chose
    for them (its update replays it); under r3 that pass replays the rollout's routing. Metrics:
    ``routing/mismatch`` and ``routing/mismatch_replayed`` of the pass when it replayed a record
    (:mod:`megarlhf.learner.routing_replay`)."""
    record = config.algorithm.routing_replay == "r2"
    if actor.routing_replay is not None:
        actor.routing_replay.reset_counts()  # this pass's metrics only (not a probe's or calibration's)
    out = _logprob_pass(actor, batch.replace(routed_experts=None) if record else batch, config,
                        record_routing=record)
    fields = {"old_logprobs": out["logprobs"]}
    if record:
        fields["routed_experts"] = out["routing"]
    metrics = {}
    if actor.routing_replay is not None:
        metrics = actor.routing_replay.mismatch_metrics(actor.runtime, "routing/")
    return batch.replace(**fields), metrics


def compute_values(critic: TrainModel, batch: ExperienceBatch, config: RunConfig) -> Tensor:
    """Critic values [B, L] at ``batch``'s response tokens."""
    mbs = micro_batches_for(batch.input_ids, batch.lengths, batch.response_mask, config, critic.runtime)
    return forward_only(critic.model, mbs, tuple(batch.input_ids.shape), critic.runtime,
                        Outputs("values", critic.vocab_size))["values"]


def old_logprobs_from_update(config: RunConfig) -> bool:
    """Whether :func:`actor_update` can take the "old" log-probs from its own forward: one optimizer step
    per call (so its forward runs the pre-update policy), and nothing needs them before that forward:
    gap masking changes the loss's token count, KL-in-reward and a distillation advantage build advantages
    from them. (Truncated IS weights are per token or per sequence, so each micro-batch computes its own.)"""
    algo = config.algorithm
    return (config.train.updates_per_step == 1 and not algo.kl_in_reward and algo.mismatch.mask_threshold is None
            and not distills_into(config, "advantage"))


def logprob_backend(config: RunConfig) -> str:
    """The log-prob op every pass of the run uses: "torch" when the update's forward takes the teacher's top-k
    (K targets per row, which only the torch op computes), so that the PPO ratio and the step-0 checks compare
    log-probs of one kernel (on GPU this gives up the Triton forward for GKD runs); else "auto"."""
    distill = distills_into(config, "loss")
    return "torch" if distill is not None and distill.needs.top_k else "auto"


def _normaliser(mask: Tensor, config: RunConfig, runtime: Runtime):
    return loss_normaliser(mask, runtime, max_response_length=config.rollout.response_budget)


def _global_mismatch_metrics(metrics: dict[str, Tensor], mask: Tensor, runtime: Runtime) -> dict[str, float]:
    """The per-rank mismatch metrics made global: token-weighted means, max of the max (reduced on the
    device, read once)."""
    count = mask.sum().double()
    names = sorted(k for k in metrics if not k.endswith("_max"))
    sums = runtime.all_reduce_on_device(torch.stack([metrics[k].double() * count for k in names] + [count]))
    peak = runtime.all_reduce_on_device(metrics["mismatch/logprob_abs_diff_max"].double().reshape(1), op="max")
    values = torch.cat([sums, peak]).tolist()  # host: the one read
    total = max(values[len(names)], 1.0)
    return {**{k: values[i] / total for i, k in enumerate(names)}, "mismatch/logprob_abs_diff_max": values[-1]}


def _distillation_loss(term: DistillTerm, mini: ExperienceBatch, mb, mask: Tensor, out: dict[str, Tensor],
                       config: RunConfig, vocab_size: int) -> Tensor:
    """``coef`` times a loss-entering distillation term of micro-batch ``mb``'s rows, per token."""
    distill, top_k = config.algorithm.distill, term.needs.top_k
    rows, width = mb.rows, mb.width
    top = {}
    if top_k:  # the student's log-probs at the teacher's top-k ids and of the rest, beside the teacher's
        top = dict(student_topk_logprobs=out["target_logprobs"], teacher_topk_logprobs=mini.teacher_topk_logprobs[
            rows, :width], student_topk_rest=out["target_rest"], teacher_topk_rest=mini.teacher_topk_rest[rows, :width],
            covers_vocabulary=distill.top_k >= vocab_size)
    inputs = DistillInputs(mask, out["logprobs"], mini.teacher_logprobs[rows, :width], **top)
    return distill.coef * term(inputs, distill)


def _actor_loss_fn(mini: ExperienceBatch, mask: Tensor, is_weights: Tensor | None, config: RunConfig,
                   normaliser, seen_logprobs: Tensor | None = None, vocab_size: int = 0):
    """The actor's per-micro-batch loss; without ``mini.old_logprobs`` the forward's own (detached)
    log-probs are the old ones and are written into ``seen_logprobs`` [B, L]."""
    algo = config.algorithm
    factor = float(normaliser.grad_average_factor)
    policy_loss = POLICY_LOSSES.get(algo.policy_loss)
    distill = distills_into(config, "loss")

    def loss_fn(mb, out):
        rows, width = mb.rows, mb.width
        m = mask[rows, :width]
        lp = out["logprobs"]
        weights = None if is_weights is None else is_weights[rows, :width]
        if mini.old_logprobs is None:
            old = lp.detach()
            seen_logprobs[rows, :width] = old
            if mini.rollout_logprobs is not None and algo.mismatch.tis_level is not None:
                # TIS weights are per token or per row: local to the micro-batch
                weights = truncated_is_weights(old, mini.rollout_logprobs[rows, :width], m, algo.mismatch.tis_level,
                                               algo.mismatch.tis_cap)
        else:
            old = mini.old_logprobs[rows, :width]
        result = policy_loss(PolicyLossInputs(lp, old, mini.advantages[rows, :width], m, weights), algo.policy)
        per_token = result.loss
        kl = torch.zeros_like(per_token)
        if algo.kl_in_loss:
            kl = kl_loss(lp, mini.ref_logprobs[rows, :width], m, algo.kl)
            per_token = per_token + kl
        if algo.entropy_coef:
            per_token = per_token + entropy_bonus(out["entropy"], m, algo.entropy_coef)
        distilled = None
        if distill is not None:
            distilled = _distillation_loss(distill, mini, mb, m, out, config, vocab_size)
            per_token = per_token + distilled
        share = aggregate_loss(per_token, m, algo.loss_aggregation, normaliser)
        with torch.no_grad():  # device tensors: reduce_metric_sums reads them once per step
            tokens = m.sum()
            metrics = {
                "loss": share.detach() / factor,
                "pg_loss": aggregate_loss(result.loss, m, algo.loss_aggregation, normaliser) / factor,
                "kl_loss": aggregate_loss(kl, m, algo.loss_aggregation, normaliser) / factor,
                "tokens": tokens,
                "clip_fraction": result.metrics["policy/clip_fraction"] * tokens,
                "ppo_kl": result.metrics["policy/ppo_kl"] * tokens,
                "entropy": torch.where(m, out["entropy"], 0.0).sum(),
            }
            if distilled is not None:
                metrics["distill_loss"] = aggregate_loss(distilled, m, algo.loss_aggregation, normaliser) / factor
        return share, metrics

    return loss_fn


def _mean_of_steps(role: str, results: list[OptimizerStepResult], per_token: tuple[str, ...],
                   per_step: tuple[str, ...]):
    done = [r for r in results if not r.skipped]
    out = {f"{role}/skipped_steps": float(len(results) - len(done)), f"{role}/lr": results[-1].lr}
    for name in per_step:
        out[f"{role}/{name}"] = sum(r.metrics[name] for r in results) / len(results)
    for name in per_token:
        out[f"{role}/{name}"] = sum(r.metrics[name] / max(r.metrics["tokens"], 1.0) for r in results) / len(results)
    out[f"{role}/grad_norm"] = (sum(r.grad_norm for r in done) / len(done)) if done else math.nan
    out.update(mean_moe_metrics(role, [r.moe for r in results if r.moe]))
    return out


def _split(items: range, parts: int) -> list[range]:
    """``parts`` contiguous splits of ``items``, the first ``len % parts`` one longer (tensor_split's rule)."""
    size, extra = divmod(len(items), parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + size + (1 if k < extra else 0))
    return [items[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]


def _mini_batch_rows(batch: ExperienceBatch, config: RunConfig, where: str):
    """The row indices of each optimizer step: ``train.mini_batches`` contiguous splits of this rank's
    batch, repeated for ``train.epochs_per_step`` epochs."""
    splits = [list(rows) for rows in _split(range(batch.batch_size), config.train.mini_batches)]
    if any(not rows for rows in splits):
        raise ConfigError(f"{where}: {batch.batch_size} sequences on this rank cannot fill "
                          f"train.mini_batches={config.train.mini_batches} mini-batches")
    for _ in range(config.train.epochs_per_step):
        yield from splits


def actor_update(actor: TrainModel, batch: ExperienceBatch, config: RunConfig, *,
                 on_nonfinite: str = "abort") -> dict[str, float]:
    """Trains the actor on this DP rank's ``batch`` (needs advantages, ref_logprobs when
    ``algorithm.kl_in_loss``, and old_logprobs unless :func:`old_logprobs_from_update`); returns the
    metrics of the module docstring, identical on every rank."""
    algo = config.algorithm
    from_update = batch.old_logprobs is None
    if from_update and not old_logprobs_from_update(config):
        raise ValueError("actor_update: the batch has no old_logprobs, and this configuration needs them before "
                         "the update (train.mini_batches / train.epochs_per_step > 1, "
                         "algorithm.mismatch.mask_threshold, or algorithm.kl_mode='reward' with kl.coef > 0)")
    distill = distills_into(config, "loss")
    top_k = distill is not None and distill.needs.top_k
    needed = ["advantages"] + (["ref_logprobs"] if algo.kl_in_loss else [])
    if distill is not None:
        needed += ["teacher_logprobs"] + (["teacher_topk_logprobs", "teacher_topk_rest"] if top_k else [])
    batch.require("actor_update", *needed)
    extra = ["distill_loss"] if distill else []
    sums, per_step = ACTOR_SUMS + extra, ("loss", "pg_loss", "kl_loss", *extra)
    runtime = actor.runtime
    mask, is_weights, metrics = batch.response_mask, None, {}
    if batch.rollout_logprobs is not None and not from_update:
        corrected = rollout_correction(batch.old_logprobs, batch.rollout_logprobs, mask, algo.mismatch)
        metrics.update(_global_mismatch_metrics(corrected.metrics, mask, runtime))
        mask, is_weights = corrected.response_mask, corrected.is_weights
    batch = batch.replace(response_mask=mask)
    seen = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.device) if from_update else None
    results = []
    for rows in _mini_batch_rows(batch, config, "actor_update"):
        mini = batch.select(rows)
        weights = None if is_weights is None else is_weights[rows, :mini.input_ids.shape[1]]
        normaliser = _normaliser(mini.response_mask, config, runtime)
        if normaliser.num_tokens == 0:
            results.append(skipped_step(actor, sums, NOTHING_TO_TRAIN))
            continue
        mbs = micro_batches_for(mini.input_ids, mini.lengths, mini.response_mask, config, runtime,
                                routing=mini.routed_experts if actor.routing_replay is not None else None)
        for mb in mbs if top_k else ():  # the student's log-probs at the teacher's top-k ids
            mb.target_ids = mb.to_positions(mini.teacher_topk_ids[mb.rows, :mb.width])
        loss_fn = _actor_loss_fn(mini, mini.response_mask, weights, config, normaliser, seen, actor.vocab_size)
        outputs = Outputs("logprobs", actor.vocab_size, scoring_temperature(config.rollout), entropy=True, at_ids=top_k,
                          backend=logprob_backend(config))
        results.append(optimizer_step(actor, mbs, loss_fn, sums, loss_name="loss", outputs=outputs,
                                      on_nonfinite=on_nonfinite))
    if from_update and batch.rollout_logprobs is not None:
        seen = runtime.broadcast_from_last_stage(seen)
        corrected = rollout_correction(seen, batch.rollout_logprobs, mask, algo.mismatch)
        metrics.update(_global_mismatch_metrics(corrected.metrics, mask, runtime))
    metrics.update(_mean_of_steps("actor", results, ("clip_fraction", "ppo_kl", "entropy"), per_step))
    metrics["train/shared_prefix_tokens_saved"] = sum(r.metrics[PREFIX_TOKENS_SAVED] for r in results)
    return metrics


def _critic_loss_fn(mini: ExperienceBatch, config: RunConfig, normaliser):
    algo = config.algorithm
    factor = float(normaliser.grad_average_factor)

    def loss_fn(mb, out):
        rows, width = mb.rows, mb.width
        m = mini.response_mask[rows, :width]
        result = value_loss(out["values"], mini.values[rows, :width], mini.returns[rows, :width], m,
                            algo.value_clip)
        share = aggregate_loss(result.loss, m, algo.loss_aggregation, normaliser)
        tokens = m.sum()
        return share, {"value_loss": share.detach() / factor, "tokens": tokens,
                       "value_clip_fraction": result.metrics["value/clip_fraction"].detach() * tokens}

    return loss_fn


def critic_update(critic: TrainModel, batch: ExperienceBatch, config: RunConfig, *,
                  on_nonfinite: str = "abort") -> dict[str, float]:
    """Trains the critic on this DP rank's ``batch`` (needs values and returns)."""
    batch.require("critic_update", "values", "returns")
    results = []
    for rows in _mini_batch_rows(batch, config, "critic_update"):
        mini = batch.select(rows)
        normaliser = _normaliser(mini.response_mask, config, critic.runtime)
        if normaliser.num_tokens == 0:
            results.append(skipped_step(critic, CRITIC_SUMS, NOTHING_TO_TRAIN))
            continue
        mbs = micro_batches_for(mini.input_ids, mini.lengths, mini.response_mask, config, critic.runtime)
        results.append(optimizer_step(critic, mbs, _critic_loss_fn(mini, config, normaliser), CRITIC_SUMS,
                                      loss_name="value_loss", on_nonfinite=on_nonfinite))
    return _mean_of_steps("critic", results, ("value_clip_fraction",), ("value_loss",))
