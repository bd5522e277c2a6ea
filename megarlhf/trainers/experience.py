"""Steps 6-8 of an RL step: rewards for the rollout, scoring by actor/reference/critic, advantages.

Every function works on this data-parallel replica's share of the global batch; samples of one prompt
always sit together on one replica, so group statistics (GRPO, RLOO, ...) are exact.
"""
from __future__ import annotations

import torch

from megarlhf.algorithms import (ADVANTAGE_ESTIMATORS, AdvantageInputs, dynamic_sampling_filter,
                                 kl_reward_penalty, overlong_penalty)
from megarlhf.config.schema import RunConfig
from megarlhf.data.prompts import PromptExample
from megarlhf.rewards import CombinedReward, RewardInput
from megarlhf.rollout.engine import RolloutBatch
from megarlhf.training import (ExperienceBatch, TrainModel, compute_logprobs, compute_values,
                               old_logprobs_from_update)


class Step0GateError(RuntimeError):
    """At step 0 the trainer's log-probs of the rollout disagree with the engine's beyond tolerance."""


def score_rewards(reward: CombinedReward, examples: list[PromptExample], rollout: RolloutBatch, tokenizer,
                  config: RunConfig, shape_length: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """Rewards [N] of the rollout's samples and metrics; with ``shape_length``, DAPO's overlong
    penalty is added when configured (evaluation scores answers only)."""
    samples = [RewardInput(prompt=examples[p].prompt, response=tokenizer.decode(r, skip_special_tokens=True),
                           ground_truth=examples[p].ground_truth, metadata=examples[p].metadata)
               for p, r in zip(rollout.prompt_index, rollout.response_ids)]
    result = reward(samples)
    for failure in result.failures:
        print(f"[reward] sample {failure}", flush=True)
    rewards = torch.tensor(result.rewards, dtype=torch.float32)
    metrics = dict(result.metrics)
    overlong = config.algorithm.overlong
    if overlong is not None and shape_length:
        lengths = torch.tensor([len(r) for r in rollout.response_ids])
        penalty = overlong_penalty(lengths, config.rollout.max_new_tokens, overlong)
        rewards = rewards + penalty
        metrics["reward/overlong_penalty_mean"] = penalty.mean().item()
    return rewards, metrics


def build_experience(rollout: RolloutBatch, group_offset: int, pad_id: int) -> ExperienceBatch:
    """The token-aligned batch of the rollout; group ids are global prompt positions."""
    return ExperienceBatch.from_sequences(
        rollout.prompt_ids, rollout.response_ids, pad_id=pad_id, rollout_logprobs=rollout.logprobs,
        group_ids=[group_offset + p for p in rollout.prompt_index])


def score(batch: ExperienceBatch, config: RunConfig, actor: TrainModel, reference: TrainModel | None,
          critic: TrainModel | None, gate_step0: bool) -> tuple[ExperienceBatch, dict[str, float]]:
    """Adds reference log-probs, critic values and the actor's old log-probs; checks the step-0 gate.

    The actor's scoring pass is skipped when the update's own forward gives the same numbers
    (:func:`megarlhf.training.old_logprobs_from_update`), except at step 0, whose gate must hold before
    any update."""
    fields, metrics = {}, {}
    if gate_step0 or not old_logprobs_from_update(config):
        fields["old_logprobs"] = compute_logprobs(actor, batch, config)
    if reference is not None:
        fields["ref_logprobs"] = compute_logprobs(reference, batch, config)
    if critic is not None:
        fields["values"] = compute_values(critic, batch, config)
    if gate_step0:
        gap = (fields["old_logprobs"] - batch.rollout_logprobs).abs()[batch.response_mask]
        metrics["mismatch/step0_logprob_gap_max"] = gap.max().item() if gap.numel() else 0.0
        if metrics["mismatch/step0_logprob_gap_max"] > config.train.step0_logprob_tolerance:
            raise Step0GateError(
                f"step-0 gate: the actor's log-probs of the rollout differ from vLLM's by up to "
                f"{metrics['mismatch/step0_logprob_gap_max']:.3e} (train.step0_logprob_tolerance="
                f"{config.train.step0_logprob_tolerance}); the engine does not run the model being trained")
    return batch.replace(**fields), metrics


def compute_advantages(batch: ExperienceBatch, rewards: torch.Tensor, config: RunConfig,
                       baseline_rewards: torch.Tensor | None = None) -> tuple[ExperienceBatch, dict[str, float]]:
    """Runs the configured estimator; KL enters as a token reward when ``kl_mode == "reward"``.

    With DAPO dynamic sampling, samples of groups whose rewards are all equal are masked out of the
    update (their advantage is zero anyway; masking keeps every rank's batch shape intact).
    """
    from megatron.core import parallel_state as ps

    algo, mask, metrics = config.algorithm, batch.response_mask, {}
    token_rewards = None
    if algo.kl_mode == "reward" and batch.ref_logprobs is not None:
        token_rewards = kl_reward_penalty(None, batch.old_logprobs, batch.ref_logprobs, mask, algo.kl)
    inputs = AdvantageInputs(rewards=rewards, response_mask=mask, token_rewards=token_rewards,
                             values=batch.values, group_ids=batch.group_ids, baseline_rewards=baseline_rewards)
    dp_group = ps.get_data_parallel_group() if ps.get_data_parallel_world_size() > 1 else None
    out = ADVANTAGE_ESTIMATORS.get(algo.estimator)(inputs, algo.advantage, dp_group=dp_group)
    if algo.dynamic_sampling:
        kept = dynamic_sampling_filter(rewards, batch.group_ids)
        keep_rows = torch.zeros(batch.batch_size, dtype=torch.bool)
        keep_rows[kept.kept_indices] = True
        mask = mask & keep_rows[:, None]
        metrics.update({"dapo/groups_dropped": float(kept.num_groups_dropped),
                        "dapo/groups": float(kept.num_groups)})
    return batch.replace(advantages=out.advantages, returns=out.returns, response_mask=mask), metrics


def rollout_metrics(rollout: RolloutBatch, rewards: torch.Tensor) -> dict[str, float]:
    """Reward and response-length statistics over the global batch (all data-parallel replicas)."""
    from megatron.core import parallel_state as ps

    lengths = torch.tensor([len(r) for r in rollout.response_ids], dtype=torch.float64)
    truncated = float(sum(reason == "length" for reason in rollout.finish_reasons))
    r = rewards.double()
    sums = torch.tensor([len(lengths), r.sum(), (r * r).sum(), lengths.sum(), truncated], dtype=torch.float64)
    peak = lengths.max().reshape(1) if len(lengths) else torch.zeros(1, dtype=torch.float64)
    if ps.get_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(sums, group=ps.get_data_parallel_group())
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=ps.get_data_parallel_group())
    n, r_sum, r_sq, len_sum, trunc = sums.tolist()
    mean = r_sum / n
    return {"reward/mean": mean, "reward/std": max(r_sq / n - mean * mean, 0.0) ** 0.5,
            "response_len/mean": len_sum / n, "response_len/max": peak.item(),
            "response/truncated_fraction": trunc / n}
