"""Steps 7-8 of an RL step: the experience batch of a rollout, its scoring by actor/reference/critic (with
the step-0 gate), and its advantages (step 6, the rewards, is :mod:`megarlhf.loops.rewarding`).

Every function works on this data-parallel replica's share of the global batch; samples of one prompt
always sit together on one replica, so group statistics (GRPO, RLOO, ...) are exact.
"""
from __future__ import annotations

import torch

from megarlhf.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, kl_reward_penalty
from megarlhf.algorithms.distillation import DistillInputs, distills_into
from megarlhf.config.schema import RunConfig
from megarlhf.rollout.sync.gates import Step0Gate, routing_flips
from megarlhf.rollout.engines.sampling import RolloutBatch
from megarlhf.rollout.engines.routing import share_prompt_routing
from megarlhf.learner import (ExperienceBatch, TrainModel, compute_logprobs, compute_values, old_logprobs_from_update,
                               old_policy_logprobs)
from megarlhf.learner.teacher import teacher_scores
from parallel.runtime import Runtime


class Step0GateError(RuntimeError):
    """At step 0 the trainer's log-probs of the rollout disagree with the engine's beyond tolerance."""


def build_experience(rollout: RolloutBatch, group_offset: int, pad_id: int, device: torch.device) -> ExperienceBatch:
    """The token-aligned batch of the rollout on ``device``; group ids are global prompt positions. In
    multi-turn rollouts only the model's tokens are response tokens (observations are masked out). An engine
    that recorded routing (routing replay r3) gives the batch its records, one prompt routing per prompt
    (:func:`~megarlhf.rollout.engines.routing.share_prompt_routing`)."""
    return ExperienceBatch.from_sequences(  # dataset responses (GKD's off-policy steps) have no behaviour log-probs
        rollout.prompt_ids, rollout.response_ids, device=device, pad_id=pad_id,
        rollout_logprobs=rollout.logprobs or None, group_ids=[group_offset + p for p in rollout.prompt_index], loss_masks=rollout.loss_masks or None,
        routed_experts=(share_prompt_routing(rollout.prompt_index, rollout.prompt_ids, rollout.routed_experts)
                        if rollout.routed_experts else None))


def score(batch: ExperienceBatch, config: RunConfig, actor: TrainModel, reference: TrainModel | None,
          critic: TrainModel | None, gates: Step0Gate | None = None,
          teacher: TrainModel | None = None) -> tuple[ExperienceBatch, dict[str, float]]:
    """Adds reference log-probs, critic values, the teacher's scores (:func:`~megarlhf.learner.teacher.
    teacher_scores`) and the actor's old log-probs; with ``gates`` (step 0) checks the step-0 gate.

    The actor's scoring pass is skipped when the update's own forward gives the same numbers
    (:func:`megarlhf.learner.old_logprobs_from_update`), except at step 0, whose gate must hold before
    any update. The gate (:mod:`megarlhf.rollout.sync.gates`) bounds the max and the mean gap over the response
    tokens of the whole global batch. Routing replay (an MoE actor) works in the actor's pass
    (:func:`megarlhf.learner.old_policy_logprobs`)."""
    fields, metrics = {}, {}
    gate_step0 = gates is not None
    if gate_step0 or not old_logprobs_from_update(config):
        batch, metrics = old_policy_logprobs(actor, batch, config)
        fields["old_logprobs"] = batch.old_logprobs
    if reference is not None:
        fields["ref_logprobs"] = compute_logprobs(reference, batch, config)
    if critic is not None:
        fields["values"] = compute_values(critic, batch, config)
    if teacher is not None:
        fields.update(teacher_scores(teacher, batch, config))
        student = fields.get("old_logprobs", batch.rollout_logprobs)
        if student is not None:
            metrics["distill/reverse_kl"] = _token_mean(student - fields["teacher_logprobs"], batch, actor.runtime)
    if gate_step0:
        flips = routing_flips(config, actor.provider.is_moe, replayed=config.algorithm.routing_replay == "r3")
        metrics.update(_step0_gate(fields["old_logprobs"], batch, gates, actor.runtime, flips))
    return batch.replace(**fields), metrics


def _token_mean(values: torch.Tensor, batch: ExperienceBatch, runtime: Runtime) -> float:
    """The mean of ``values`` over the response tokens of the global batch (every data-parallel rank's)."""
    mask = batch.response_mask
    sums = torch.stack([mask.sum().double(), torch.where(mask, values.double(), 0.0).sum()])
    count, total = runtime.all_reduce_on_device(sums).tolist()  # host: one read
    return total / max(count, 1.0)


def _step0_gate(logprobs: torch.Tensor, batch: ExperienceBatch, gates: Step0Gate,
                runtime: Runtime, likely_cause: str | None) -> dict[str, float]:
    """The step-0 gate; ``likely_cause``: what a gap points to besides a wrong engine (MoE routing flips)."""
    gap = (logprobs - batch.rollout_logprobs).abs()[batch.response_mask]
    count, total = runtime.all_reduce([gap.numel(), gap.double().sum()])
    worst = runtime.all_reduce([gap.max() if gap.numel() else 0.0], op="max")[0]
    mean = total / max(count, 1.0)
    problems = gates.step0_problems(worst, mean)
    if problems:
        cause = likely_cause or "the engine does not run the model being trained"
        raise Step0GateError(f"{'; '.join(problems)}: the actor's log-probs of the first rollout differ from the "
                             f"engine's: {cause}")
    return {"mismatch/step0_logprob_gap_max": worst, "mismatch/step0_logprob_gap_mean": mean}


def compute_advantages(batch: ExperienceBatch, rewards: list[float], config: RunConfig, runtime: Runtime,
                       baseline_rewards: list[float] | None = None,
                       informative: list[bool] | None = None) -> tuple[ExperienceBatch, dict[str, float]]:
    """Runs the configured estimator; KL enters as a token reward when ``algorithm.kl_in_reward``.

    ``informative`` (DAPO dynamic sampling) marks the samples to train on; the others are masked out of
    the update (their group's rewards were all equal).
    """
    algo, mask, device = config.algorithm, batch.response_mask, batch.device
    token_rewards = None
    if algo.kl_in_reward:
        token_rewards = kl_reward_penalty(None, batch.old_logprobs, batch.ref_logprobs, mask, algo.kl)
    baseline = (torch.tensor(baseline_rewards, dtype=torch.float32, device=device)
                if baseline_rewards is not None else None)
    inputs = AdvantageInputs(rewards=torch.tensor(rewards, dtype=torch.float32, device=device), response_mask=mask,
                             token_rewards=token_rewards, values=batch.values, group_ids=batch.group_ids,
                             baseline_rewards=baseline)
    out = ADVANTAGE_ESTIMATORS.get(algo.estimator)(inputs, algo.advantage, dp_group=runtime.dp.group)
    advantages = out.advantages
    distill = distills_into(config, "advantage")
    if distill is not None:  # on-policy distillation: the teacher's per-token advantage joins the task's
        term = distill(DistillInputs(mask, batch.old_logprobs, batch.teacher_logprobs), algo.distill)
        advantages = advantages + algo.distill.coef * term.to(advantages.dtype)
    if informative is not None:
        mask = mask & torch.tensor(informative, dtype=torch.bool, device=device)[:, None]
    return batch.replace(advantages=advantages, returns=out.returns, response_mask=mask), {}


