"""Steps 6-8 of an RL step: rewards for the rollout, scoring by actor/reference/critic, advantages.

Every function works on this data-parallel replica's share of the global batch; samples of one prompt
always sit together on one replica, so group statistics (GRPO, RLOO, ...) are exact.
"""
from __future__ import annotations

import itertools

import torch

from megarlhf.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, kl_reward_penalty, overlong_penalty
from megarlhf.config.schema import RunConfig
from megarlhf.data.prompts import PromptExample
from megarlhf.gates import Tolerances, gap_problems
from megarlhf.rewards import CombinedReward, RewardInput
from megarlhf.rollout.batch import RolloutBatch
from megarlhf.training import (ExperienceBatch, TrainModel, build_reward_model, compute_logprobs, compute_values,
                               old_logprobs_from_update)
from megarlhf.training.learned_reward import LearnedReward, check_reward_model
from parallel.runtime import Runtime


class Step0GateError(RuntimeError):
    """At step 0 the trainer's log-probs of the rollout disagree with the engine's beyond tolerance."""


def build_reward(config: RunConfig, runtime: Runtime, tokenizer) -> tuple[CombinedReward, TrainModel | None]:
    """The run's reward and, with ``reward.reward_model_path``, the frozen reward model it scores with
    (a trainer-side model: colocate it with the others so it is offloaded around rollouts)."""
    path = config.reward.reward_model_path
    if path is None:
        return CombinedReward(config.reward), None
    check_reward_model(path, tokenizer)
    model = build_reward_model(config, runtime, path, trainable=False)
    return CombinedReward(config.reward, LearnedReward(model, config, config.reward)), model


def model_text(tokenizer, response_ids: list[int], loss_mask: list[int] | None) -> str:
    """What the model wrote in a response: with a multi-turn ``loss_mask``, its own turns (each decoded
    alone, joined by newlines) without the observations between them, which are not its answer."""
    if not loss_mask:
        return tokenizer.decode(response_ids, skip_special_tokens=True)
    runs = itertools.groupby(zip(response_ids, loss_mask), key=lambda pair: bool(pair[1]))
    turns = [[token for token, _ in run] for own, run in runs if own]
    return "\n".join(tokenizer.decode(turn, skip_special_tokens=True).strip() for turn in turns)


def score_rewards(reward: CombinedReward, examples: list[PromptExample], rollout: RolloutBatch, tokenizer,
                  config: RunConfig, training: bool = True) -> tuple[list[float], dict[str, float]]:
    """Rewards (one per sample of the rollout) and metrics. Reward functions read the model's own text
    (:func:`model_text`); a reward model scores the whole token sequence. In ``training`` the environment's
    rewards of multi-turn episodes and DAPO's overlong penalty (when configured) join; evaluation scores
    the answer only."""
    masks = rollout.loss_masks or [None] * len(rollout.response_ids)
    samples = [RewardInput(prompt=examples[p].prompt, response=model_text(tokenizer, r, m),
                           ground_truth=examples[p].ground_truth, metadata=examples[p].metadata,
                           prompt_ids=tuple(examples[p].prompt_ids), response_ids=tuple(r))
               for p, r, m in zip(rollout.prompt_index, rollout.response_ids, masks)]
    result = reward(samples)
    for failure in result.failures:
        print(f"[reward] sample {failure}", flush=True)
    rewards = list(result.rewards)
    metrics = dict(result.metrics)
    if rollout.env_rewards and training:  # multi-turn episodes: the environment's own rewards join the sample's
        rewards = [r + e for r, e in zip(rewards, rollout.env_rewards)]
        metrics["reward/env/mean"] = sum(rollout.env_rewards) / max(len(rollout.env_rewards), 1)
    overlong = config.algorithm.overlong
    if overlong is not None and training:
        lengths = torch.tensor([len(r) for r in rollout.response_ids])  # host: reward bookkeeping
        penalty = overlong_penalty(lengths, config.rollout.response_budget, overlong)
        rewards = (torch.tensor(rewards, dtype=torch.float32) + penalty).tolist()  # host: as above
        metrics["reward/overlong_penalty_mean"] = penalty.mean().item()
    return rewards, metrics


def global_reward_metrics(metrics: dict[str, float], samples: int, runtime: Runtime) -> dict[str, float]:
    """This replica's reward metrics (``score_rewards``) over all replicas: means weighted by each
    replica's ``samples``, counts summed."""
    names = sorted(metrics)
    values = runtime.all_reduce([metrics[k] * samples if k.endswith("mean") else metrics[k] for k in names]
                                + [float(samples)])
    total = max(values[-1], 1.0)
    return {k: v / total if k.endswith("mean") else v for k, v in zip(names, values)}


def build_experience(rollout: RolloutBatch, group_offset: int, pad_id: int, device: torch.device) -> ExperienceBatch:
    """The token-aligned batch of the rollout on ``device``; group ids are global prompt positions. In
    multi-turn rollouts only the model's tokens are response tokens (observations are masked out)."""
    return ExperienceBatch.from_sequences(
        rollout.prompt_ids, rollout.response_ids, device=device, pad_id=pad_id, rollout_logprobs=rollout.logprobs,
        group_ids=[group_offset + p for p in rollout.prompt_index], loss_masks=rollout.loss_masks or None)


def tool_metrics(counts: dict[str, float], runtime: Runtime, prefix: str = "tools/") -> dict[str, float]:
    """The multi-turn counts of every replica (:mod:`megarlhf.rollout.multi_turn`; each rank holds its
    replica's) summed, plus ``call_rate`` and ``turns_mean`` per sample; {} for single-turn rollouts."""
    names = sorted(k for k in counts if k.startswith("tools/"))
    if not names:
        return {}
    totals = dict(zip(names, runtime.all_reduce([counts[k] for k in names])))
    samples = max(totals["tools/samples"], 1.0)
    out = {prefix + k.removeprefix("tools/"): v for k, v in totals.items()}
    out.update({prefix + "call_rate": totals["tools/samples_calling"] / samples,
                prefix + "turns_mean": totals["tools/turns"] / samples})
    return out


def score(batch: ExperienceBatch, config: RunConfig, actor: TrainModel, reference: TrainModel | None,
          critic: TrainModel | None, gates: Tolerances | None = None) -> tuple[ExperienceBatch, dict[str, float]]:
    """Adds reference log-probs, critic values and the actor's old log-probs; with ``gates`` (step 0)
    checks the step-0 gate.

    The actor's scoring pass is skipped when the update's own forward gives the same numbers
    (:func:`megarlhf.training.old_logprobs_from_update`), except at step 0, whose gate must hold before
    any update. The gate (:mod:`megarlhf.gates`) bounds the max and the mean gap over the response
    tokens of the whole global batch."""
    fields, metrics = {}, {}
    gate_step0 = gates is not None
    if gate_step0 or not old_logprobs_from_update(config):
        fields["old_logprobs"] = compute_logprobs(actor, batch, config)
    if reference is not None:
        fields["ref_logprobs"] = compute_logprobs(reference, batch, config)
    if critic is not None:
        fields["values"] = compute_values(critic, batch, config)
    if gate_step0:
        metrics.update(_step0_gate(fields["old_logprobs"], batch, gates, actor.runtime))
    return batch.replace(**fields), metrics


def _step0_gate(logprobs: torch.Tensor, batch: ExperienceBatch, tolerances: Tolerances,
                runtime: Runtime) -> dict[str, float]:
    gap = (logprobs - batch.rollout_logprobs).abs()[batch.response_mask]
    count, total = runtime.all_reduce([gap.numel(), gap.double().sum()])
    worst = runtime.all_reduce([gap.max() if gap.numel() else 0.0], op="max")[0]
    mean = total / max(count, 1.0)
    problems = gap_problems("step-0 gate", worst, mean, tolerances.step0_max, tolerances.step0_mean,
                            ("step0_max", "step0_mean"))
    if problems:
        raise Step0GateError(f"{'; '.join(problems)}: the actor's log-probs of the first rollout differ from the "
                             f"engine's, so the engine does not run the model being trained")
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
    if informative is not None:
        mask = mask & torch.tensor(informative, dtype=torch.bool, device=device)[:, None]
    return batch.replace(advantages=out.advantages, returns=out.returns, response_mask=mask), {}


def rollout_metrics(rollout: RolloutBatch, rewards: list[float], runtime: Runtime) -> dict[str, float]:
    """Reward and response-length statistics over the global batch (all data-parallel replicas)."""
    lengths = [len(r) for r in rollout.response_ids]
    truncated = float(sum(reason == "length" for reason in rollout.finish_reasons))
    r = torch.tensor(rewards, dtype=torch.float32).double()  # host: the rewards as the estimator sees them
    n, r_sum, r_sq, len_sum, trunc = runtime.all_reduce(
        [len(lengths), r.sum().item(), (r * r).sum().item(), sum(lengths), truncated])
    peak = runtime.all_reduce([max(lengths, default=0)], op="max")[0]
    mean = r_sum / n
    return {"reward/mean": mean, "reward/std": max(r_sq / n - mean * mean, 0.0) ** 0.5,
            "response_len/mean": len_sum / n, "response_len/max": peak,
            "response/truncated_fraction": trunc / n}
