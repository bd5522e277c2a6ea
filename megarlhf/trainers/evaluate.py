"""Evaluation on held-out prompts: accuracy and pass@k of the current actor, through the rollout engine.

A sample counts as correct when its reward is above 0.5, i.e. the run's reward is a 0/1 verifier
(math_verify, exact_match, numeric). ``eval/accuracy`` is the mean correctness over all samples;
``eval/pass@k`` is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
Trained on Code"): for a prompt with ``c`` correct of ``n`` samples, ``1 - C(n-c, k) / C(n, k)``,
averaged over prompts. The eval prompts are split over data-parallel replicas and the sums all-reduced.
"""
from __future__ import annotations

from math import comb

import torch

from megarlhf.config.schema import RunConfig
from megarlhf.data.prompts import PromptExample
from megarlhf.rewards import CombinedReward
from megarlhf.rollout.engine import SamplingConfig
from megarlhf.trainers.experience import score_rewards
from megarlhf.trainers.rollout_phase import sample_seed

EVAL_SEED_OFFSET = 1 << 40  # eval samples never share seeds with training samples


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def eval_sampling(config: RunConfig, stop_token_ids: tuple[int, ...]) -> SamplingConfig:
    return SamplingConfig(n=config.eval.n_samples, temperature=config.eval.temperature,
                          top_p=1.0 if config.eval.temperature == 0 else config.rollout.top_p,
                          max_new_tokens=config.rollout.max_new_tokens, stop_token_ids=stop_token_ids)


def evaluate(phase, examples: list[PromptExample], reward: CombinedReward, tokenizer,
             config: RunConfig, step: int, dp_rank: int, dp_size: int,
             stop_token_ids: tuple[int, ...] = ()) -> dict[str, float]:
    """``eval/accuracy``, ``eval/pass@k`` and ``eval/prompts`` over ``examples`` (all replicas together);
    ``phase`` is the run's rollout side (:func:`~megarlhf.trainers.rollout_phase.build_rollout_phase`)."""
    from megatron.core import parallel_state as ps

    if config.eval.max_prompts is not None:
        examples = examples[:config.eval.max_prompts]
    share = torch.arange(len(examples)).tensor_split(dp_size)[dp_rank].tolist()
    mine = [examples[i] for i in share]
    n = config.eval.n_samples
    sums = torch.zeros(2 + len(config.eval.pass_at_k), dtype=torch.float64)  # prompts, correct samples, pass@k
    if mine:
        seed = sample_seed(config.seed + EVAL_SEED_OFFSET, step, share[0], n)
        rollout, _ = phase.generate([e.prompt_ids for e in mine], eval_sampling(config, stop_token_ids), seed)
        rewards, _ = score_rewards(reward, mine, rollout, tokenizer, config, shape_length=False)
        correct = torch.zeros(len(mine))
        for p, r in zip(rollout.prompt_index, rewards.tolist()):
            correct[p] += float(r > 0.5)
        sums[0], sums[1] = len(mine), correct.sum()
        for j, k in enumerate(config.eval.pass_at_k):
            sums[2 + j] = sum(pass_at_k(n, int(c), k) for c in correct.tolist())
    if dp_size > 1:
        torch.distributed.all_reduce(sums, group=ps.get_data_parallel_group())
    prompts = sums[0].item()
    metrics = {"eval/prompts": prompts, "eval/accuracy": sums[1].item() / (prompts * n)}
    for j, k in enumerate(config.eval.pass_at_k):
        metrics[f"eval/pass@{k}"] = sums[2 + j].item() / prompts
    return metrics
