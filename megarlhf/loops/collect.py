"""Steps 1-6 of an RL step: draw prompts, generate (steps 2-5, the rollout phase), score rewards; with
DAPO's dynamic sampling, repeated until the batch holds enough informative groups.

Without dynamic sampling one round is made: this data-parallel replica's share of the next global batch.

With ``algorithm.dynamic_sampling.enabled`` (Yu et al. 2025, DAPO sec. 3.2) a group (the samples of one
prompt) is *informative* when its rewards are not all equal; a uniform group has zero group-relative
advantage and no gradient. Rounds are generated until the informative groups found reach
``train.global_batch_size`` or ``max_extra_rounds`` extra rounds were made. Each round draws the next
global batch from the sampler (so extra rounds consume data, as in DAPO) and samples with seeds that
depend on the round, so the whole procedure is reproducible and resumable. The groups of every round
are gathered over the data-parallel ranks in a fixed order (round, global prompt position); the step
trains on the first ``train.global_batch_size`` informative ones, and if fewer were found the batch is
filled with uninformative groups, marked so that they are masked out of the update (an all-uniform
batch therefore trains on nothing and skips its optimizer step rather than failing). The chosen groups
are dealt out in contiguous shares to the data-parallel ranks, whole.

GKD's on-policy fraction (``algorithm.distill.lmbda < 1``): each step draws, from the run's seed and the
step number (the same on every rank, and on resuming), whether it samples from the student
(:func:`on_policy_step`); a step that does not trains on its prompts' dataset responses
(:func:`dataset_responses`), one per prompt, without waking the engines.

Metrics: ``dapo/rounds`` (generation rounds made), ``dapo/informative_groups`` (found over all rounds),
``dapo/filler_groups`` (uninformative groups in the trained batch), ``dapo/groups_generated``. The
``reward/*`` metrics describe the first round, i.e. the policy as it samples.

"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from megarlhf.algorithms import dynamic_sampling_filter
from megarlhf.core.errors import ConfigError, RewardsFailedError
from megarlhf.core.seeds import ROUND_STRIDE, sample_seed
from megarlhf.data.prompts import PromptExample
from megarlhf.loops.rewarding import score_rewards
from megarlhf.loops.rollout_metrics import global_reward_metrics, rollout_metrics, tool_metrics
from megarlhf.rollout.engines.sampling import RolloutBatch, rollout_sampling
from megarlhf.run.context import RunContext
from parallel.runtime import Runtime

@dataclass
class Collected:
    """This replica's share of the step: prompts, their samples and rewards."""

    examples: list[PromptExample]
    rollout: RolloutBatch  # prompt_index indexes ``examples``
    rewards: list[float]  # one per sample
    group_offset: int  # global batch position of ``examples[0]``
    informative: list[bool] | None  # per sample, dynamic sampling only (False: masked out of the update)
    metrics: dict[str, float]
    failed: list[bool] | None = None  # per sample: its reward failed (rs / online-dpo skip it); None: unknown


def _generate(run: RunContext, examples: list[PromptExample], seed: int, sync_weights: bool
              ) -> tuple[RolloutBatch, dict[str, float]]:
    sampling = rollout_sampling(run.config.rollout, run.stop_token_ids)
    return run.rollout.generate(examples, sampling, seed, sync_weights=sync_weights)


def replica_offset(run: RunContext) -> int:
    """The global batch position of this data-parallel replica's first prompt."""
    return run.runtime.dp.rank * (run.config.train.global_batch_size // run.runtime.dp.size)


def score_round(run: RunContext, examples: list[PromptExample], rollout: RolloutBatch,
                metrics: dict[str, float]) -> Collected:
    """Step 6 of one generation round of this replica: rewards and the round's metrics (global)."""
    runtime = run.runtime
    rewards, reward_metrics, failed = score_rewards(run.reward, examples, rollout, run.tokenizer, run.config)
    reward_metrics, failed_total, total = global_reward_metrics(reward_metrics, len(rewards), sum(failed), runtime)
    if total and failed_total == total:
        raise RewardsFailedError(f"all {total} samples of this step failed their reward (reward/failures; the "
                                 f"first reasons are logged as '[reward] sample ...'): nothing scored them")
    metrics = {**metrics, **reward_metrics,
               **rollout_metrics(rollout, rewards, runtime), **tool_metrics(metrics, runtime)}
    return Collected(examples, rollout, rewards, replica_offset(run), None, metrics, failed)


def on_policy_step(config, step: int) -> bool:
    """Whether ``step`` samples from the student: always, except under ``algorithm.distill.lmbda < 1``, where a
    draw from the run's seed and the step decides (with probability lmbda)."""
    distill = config.algorithm.distill
    if distill is None or distill.lmbda >= 1.0:
        return True
    return random.Random(f"{config.seed}:{step}:on-policy").random() < distill.lmbda


def check_dataset_steps(config, dp_size: int) -> None:
    """A step on dataset responses holds one sample per prompt: ``global_batch_size / dp`` rows on each rank, which
    must still fill ``train.mini_batches`` (the student's steps hold ``rollout.n_samples`` times as many)."""
    distill = config.algorithm.distill
    rows = config.train.global_batch_size // dp_size
    if distill is not None and distill.lmbda < 1 and rows < config.train.mini_batches:
        raise ConfigError(f"algorithm.distill.lmbda={distill.lmbda:g}: a step on dataset responses gives each of the "
                          f"{dp_size} data-parallel ranks {rows} rows (one per prompt), fewer than train.mini_batches="
                          f"{config.train.mini_batches}; lower train.mini_batches or raise train.global_batch_size")


def first_on_policy_step(config) -> int | None:
    """The first step that samples from the student (its first rollout: where the step-0 gate is checked), or
    None if no step of the run does."""
    return next((step for step in range(config.train.steps) if on_policy_step(config, step)), None)


def dataset_responses(examples: list[PromptExample]) -> RolloutBatch:
    """One sample per prompt: its dataset response (:attr:`PromptExample.response_ids`), with no behaviour
    log-probs (the update compares nothing with an engine)."""
    rollout = RolloutBatch()
    for p, example in enumerate(examples):
        rollout.prompt_index.append(p)
        rollout.prompt_ids.append(list(example.prompt_ids))
        rollout.response_ids.append(list(example.response_ids))
        rollout.finish_reasons.append("stop")
    return rollout


def collect(run: RunContext, sampler, prompts, step: int) -> Collected:
    """Steps 1-6 for ``step`` (see the module docstring); collective over the trainer ranks."""
    offset, n = replica_offset(run), run.config.rollout.n_samples
    examples = [prompts[i] for i in sampler.next_batch()]
    if not on_policy_step(run.config, step):
        return score_round(run, examples, dataset_responses(examples), {"distill/on_policy": 0.0})
    rollout, metrics = _generate(run, examples, sample_seed(run.config.seed, step, offset, n), True)
    if run.config.algorithm.distill is not None:
        metrics["distill/on_policy"] = 1.0
    got = score_round(run, examples, rollout, metrics)
    if not run.config.algorithm.dynamic_sampling.enabled:
        return got
    return fill_groups(run, got, sampler, prompts, step)


def fill_groups(run: RunContext, got: Collected, sampler, prompts, step: int, before_extra_rounds=dict) -> Collected:
    """Dynamic sampling after the first round ``got``: the extra rounds (with the weights the engines
    hold; collective over the trainer ranks) and the chosen groups (see the module docstring).
    ``before_extra_rounds()`` runs once before the first extra round, if one is needed; its metrics join."""
    config, runtime = run.config, run.runtime
    offset, n, size = replica_offset(run), config.rollout.n_samples, config.train.global_batch_size
    examples, rollout, rewards, metrics = got.examples, got.rollout, got.rewards, got.metrics
    rounds = [_groups(examples, rollout, rewards, runtime)]
    found = sum(g[0] for g in rounds[0])
    while found < size and len(rounds) <= config.algorithm.dynamic_sampling.max_extra_rounds:
        if len(rounds) == 1:
            metrics.update(before_extra_rounds())
        examples = [prompts[i] for i in sampler.next_batch()]
        seed = sample_seed(config.seed + len(rounds) * ROUND_STRIDE, step, offset, n)
        rollout, _ = _generate(run, examples, seed, False)
        rewards, _, _ = score_rewards(run.reward, examples, rollout, run.tokenizer, config)
        rounds.append(_groups(examples, rollout, rewards, runtime))
        found += sum(g[0] for g in rounds[-1])
    chosen = _choose(rounds, size)
    mine = chosen[offset:offset + size // runtime.dp.size]
    metrics.update({"dapo/rounds": float(len(rounds)), "dapo/informative_groups": float(found),
                    "dapo/filler_groups": float(sum(not g[0] for g in chosen)),
                    "dapo/groups_generated": float(sum(len(r) for r in rounds))})
    return _as_collected(mine, offset, metrics)


def _groups(examples: list[PromptExample], rollout: RolloutBatch, rewards: list[float],
            runtime: Runtime) -> list[tuple]:
    """Every replica's groups of one round, in global prompt order:
    ``(informative, example, prompt_ids, responses, logprobs, finish_reasons, rewards, routing records, policy
    versions)`` (the records empty unless the engine records routing: replay r3)."""
    by_prompt: dict[int, list[int]] = {}
    for k, p in enumerate(rollout.prompt_index):
        by_prompt.setdefault(p, []).append(k)
    group_ids = torch.tensor(rollout.prompt_index, dtype=torch.long)  # host: bookkeeping
    rewards_t = torch.tensor(rewards, dtype=torch.float64)  # host: as above
    kept = set(dynamic_sampling_filter(rewards_t, group_ids).kept_indices.tolist())
    local = []
    for p in range(len(examples)):
        samples = by_prompt[p]  # an engine returns n >= 1 samples for every prompt
        local.append((samples[0] in kept, examples[p], rollout.prompt_ids[samples[0]],
                      [rollout.response_ids[k] for k in samples], [rollout.logprobs[k] for k in samples],
                      [rollout.finish_reasons[k] for k in samples], [rewards[k] for k in samples],
                      [rollout.routed_experts[k] for k in samples] if rollout.routed_experts else [],
                      [rollout.policy_versions[k] for k in samples] if rollout.policy_versions else []))
    return [group for part in runtime.all_gather_objects(local, over="dp") for group in part]


def _choose(rounds: list[list[tuple]], size: int) -> list[tuple]:
    """The first ``size`` informative groups in (round, position) order, filled with uninformative ones."""
    everything = [g for groups in rounds for g in groups]
    chosen = [g for g in everything if g[0]][:size]
    return chosen + [g for g in everything if not g[0]][:size - len(chosen)]


def _as_collected(groups: list[tuple], offset: int, metrics: dict[str, float]) -> Collected:
    rollout, rewards, informative = RolloutBatch(), [], []
    for p, group in enumerate(groups):
        useful, _, prompt_ids, responses, logprobs, finishes, group_rewards, records, versions = group
        rollout.routed_experts += records
        rollout.policy_versions += versions
        for response, lps, finish, r in zip(responses, logprobs, finishes, group_rewards):
            rollout.prompt_index.append(p)
            rollout.prompt_ids.append(prompt_ids)
            rollout.response_ids.append(response)
            rollout.logprobs.append(lps)
            rollout.finish_reasons.append(finish)
            rewards.append(r)
            informative.append(useful)
    return Collected([g[1] for g in groups], rollout, rewards, offset, informative, metrics)
