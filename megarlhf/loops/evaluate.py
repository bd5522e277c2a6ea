"""Evaluation on held-out prompts: accuracy and pass@k of the current actor, through the rollout engine.

A sample counts as correct when its evaluation reward (``RunConfig.eval_reward``: ``eval.reward_functions``,
by default the run's reward functions, never a learned reward model) is above 0.5, i.e. a 0/1 verifier
(math_verify, exact_match, numeric). ``eval/accuracy`` is the mean correctness over all samples;
``eval/pass@k`` is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
Trained on Code"): for a prompt with ``c`` correct of ``n`` samples, ``1 - C(n-c, k) / C(n, k)``,
averaged over prompts. The eval prompts are split over data-parallel replicas and the sums all-reduced.
Every replica takes part in the generation round even when its share is empty (an eval set smaller
than the data-parallel size): the weight sync inside it is collective.
"""
from __future__ import annotations

from math import comb

import torch

from megarlhf.config.schema import RunConfig
from megarlhf.data.prompts import PromptExample
from megarlhf.rewards import CombinedReward
from megarlhf.rollout.engines.sampling import SamplingConfig
from megarlhf.records.sample_log import SampleLog
from megarlhf.core.seeds import EVAL_OFFSET, sample_seed
from megarlhf.loops.rewarding import score_rewards
from megarlhf.loops.rollout_metrics import tool_metrics
from parallel.runtime import Runtime



def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def eval_sampling(config: RunConfig, stop_token_ids: tuple[int, ...]) -> SamplingConfig:
    return SamplingConfig(n=config.eval.n_samples, temperature=config.eval.temperature,
                          max_new_tokens=config.rollout.max_new_tokens, stop_token_ids=stop_token_ids)


def evaluate(phase, examples: list[PromptExample], reward: CombinedReward, tokenizer, config: RunConfig,
             step: int, runtime: Runtime, stop_token_ids: tuple[int, ...] = (),
             samples: SampleLog | None = None) -> dict[str, float]:
    """``eval/accuracy``, ``eval/pass@k`` and ``eval/prompts`` over ``examples`` (all replicas together);
    ``phase`` is the run's rollout side (:func:`~megarlhf.rollout.phase.build_rollout_phase`);
    ``samples`` records some of the generations."""
    if config.eval.max_prompts is not None:
        examples = examples[:config.eval.max_prompts]
    share = torch.arange(len(examples)).tensor_split(runtime.dp.size)[runtime.dp.rank].tolist()  # host: indices
    mine = [examples[i] for i in share]
    n = config.eval.n_samples
    seed = sample_seed(config.seed + EVAL_OFFSET, step, share[0] if share else 0, n)
    # every replica generates, even with no prompt of its own: the weight sync inside is collective
    rollout, tools = phase.generate(mine, eval_sampling(config, stop_token_ids), seed)
    rewards, _ = score_rewards(reward, mine, rollout, tokenizer, config, training=False) if mine else ([], {})
    if samples is not None:  # collective over data-parallel ranks, so called with an empty share too
        samples.write(step, "eval", mine, rollout, rewards)
    correct = [0.0] * len(mine)
    for p, r in zip(rollout.prompt_index, rewards):
        correct[p] += float(r > 0.5)
    sums = [len(mine), sum(correct)] + [sum(pass_at_k(n, int(c), k) for c in correct) for k in config.eval.pass_at_k]
    sums = runtime.all_reduce(sums)
    prompts = sums[0]
    metrics = {"eval/prompts": prompts, "eval/accuracy": sums[1] / (prompts * n)}
    for j, k in enumerate(config.eval.pass_at_k):
        metrics[f"eval/pass@{k}"] = sums[2 + j] / prompts
    return {**metrics, **tool_metrics(tools, runtime, prefix="eval/tools/")}
