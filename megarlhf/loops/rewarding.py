"""Step 6 of an RL step: the run's reward, and the rewards of a rollout's samples on this replica.

Reward functions read what the model wrote (:func:`model_text`: in multi-turn episodes its own turns,
not the observations between them); a learned reward model scores the whole token sequence.
"""
from __future__ import annotations

import itertools

import torch

from megarlhf.algorithms import overlong_penalty
from megarlhf.config.schema import RunConfig
from megarlhf.data.prompts import PromptExample
from megarlhf.rewards import CombinedReward, RewardInput
from megarlhf.rollout.engines.sampling import RolloutBatch
from megarlhf.rollout.judge import EngineJudge
from megarlhf.learner import TrainModel, build_reward_model
from megarlhf.learner.learned_reward import LearnedReward, check_reward_model
from parallel.runtime import Runtime


def build_reward(config: RunConfig, runtime: Runtime, tokenizer) -> tuple[CombinedReward, TrainModel | None]:
    """The run's reward; with ``reward.reward_model_path``, the frozen reward model it scores with (a trainer-side
    model: colocate it with the others so it is offloaded around rollouts); with ``reward.judge``, the judge's
    engine (:mod:`megarlhf.rollout.judge`)."""
    path = config.reward.reward_model_path
    if path is not None:
        check_reward_model(path, tokenizer)  # before anything is built
    judge = EngineJudge.build(config, runtime) if config.reward.judge is not None else None
    if path is None:
        return CombinedReward(config.reward, judge=judge), None
    model = build_reward_model(config, runtime, path, trainable=False)
    return CombinedReward(config.reward, LearnedReward(model, config, config.reward), judge), model


def question(example: PromptExample) -> str | None:
    """The row's question as written: the last user message of a chat prompt, else None (the prompt is it)."""
    users = [m["content"] for m in example.messages or () if m.get("role") == "user"]
    return users[-1] if users else None


def model_turns(tokenizer, response_ids: list[int], loss_mask: list[int]) -> list[str]:
    """The model's own turns of a multi-turn response (each decoded alone, stripped), without the
    observations between them."""
    runs = itertools.groupby(zip(response_ids, loss_mask), key=lambda pair: bool(pair[1]))
    return [tokenizer.decode([token for token, _ in run], skip_special_tokens=True).strip() for own, run in runs
            if own]


def model_text(tokenizer, response_ids: list[int], loss_mask: list[int] | None) -> tuple[str, tuple[str, ...]]:
    """What the model wrote in a response, and its turns: with a multi-turn ``loss_mask``, its own turns
    (:func:`model_turns`) joined by newlines, without the observations between them, which are not its
    answer; else the whole response and no turns."""
    if not loss_mask:
        return tokenizer.decode(response_ids, skip_special_tokens=True), ()
    turns = tuple(model_turns(tokenizer, response_ids, loss_mask))
    return "\n".join(turns), turns


def score_rewards(reward: CombinedReward, examples: list[PromptExample], rollout: RolloutBatch, tokenizer,
                  config: RunConfig, training: bool = True) -> tuple[list[float], dict[str, float], list[bool]]:
    """Rewards (one per sample of the rollout), metrics, and which samples' reward failed (a term raised,
    timed out or returned a non-number: its value is ``reward.failure_reward``). Reward functions read the
    model's own text (:func:`model_text`); a reward model scores the whole token sequence. In ``training``
    the environment's rewards of multi-turn episodes and DAPO's overlong penalty (when configured) join;
    evaluation scores the answer only."""
    masks = rollout.loss_masks or [None] * len(rollout.response_ids)
    written = [model_text(tokenizer, r, m) for r, m in zip(rollout.response_ids, masks)]
    samples = [RewardInput(prompt=examples[p].prompt, response=text, ground_truth=examples[p].ground_truth,
                           metadata=examples[p].metadata, prompt_ids=tuple(examples[p].prompt_ids),
                           response_ids=tuple(r), turns=turns, question=question(examples[p]))
               for p, r, (text, turns) in zip(rollout.prompt_index, rollout.response_ids, written)]
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
    failed = [False] * len(rewards)
    for failure in result.failures:
        failed[failure.index] = True
    return rewards, metrics, failed
