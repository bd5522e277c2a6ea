"""A rollout's metrics over all data-parallel replicas: rewards, lengths, truncation, multi-turn counts, the
staleness of its tokens.

Each rank holds its replica's share of the global batch; these reduce the shares so that every rank logs
the numbers of the whole batch (means weighted by each replica's samples, counts summed).
"""
from __future__ import annotations

import torch

from megarlhf.records.metrics import mean_and_std
from megarlhf.rollout.engines.sampling import RolloutBatch
from parallel.runtime import Runtime


def global_reward_metrics(metrics: dict[str, float], samples: int, failed: int, runtime: Runtime
                          ) -> tuple[dict[str, float], int, int]:
    """This replica's reward metrics (``score_rewards``) over all replicas (means weighted by each replica's
    ``samples``, counts summed), the samples of all replicas that ``failed`` their reward, and all the samples;
    one collective."""
    names = sorted(metrics)
    values = runtime.all_reduce([metrics[k] * samples if k.endswith("mean") else metrics[k] for k in names]
                                + [float(failed), float(samples)])
    total = max(values[-1], 1.0)
    return {k: v / total if k.endswith("mean") else v for k, v in zip(names, values)}, int(values[-2]), int(values[-1])


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


def rollout_metrics(rollout: RolloutBatch, rewards: list[float], runtime: Runtime) -> dict[str, float]:
    """Reward and response-length statistics over the global batch (all data-parallel replicas)."""
    lengths = [len(r) for r in rollout.response_ids]
    truncated = float(sum(reason == "length" for reason in rollout.finish_reasons))
    r = torch.tensor(rewards, dtype=torch.float32).double()  # host: the rewards as the estimator sees them
    n, r_sum, r_sq, len_sum, trunc = runtime.all_reduce(
        [len(lengths), r.sum().item(), (r * r).sum().item(), sum(lengths), truncated])
    peak = runtime.all_reduce([max(lengths, default=0)], op="max")[0]
    mean, std = mean_and_std(n, r_sum, r_sq)
    return {"reward/mean": mean, "reward/std": std,
            "response_len/mean": len_sum / n, "response_len/max": peak,
            "response/truncated_fraction": trunc / n}


def staleness_metrics(rollout: RolloutBatch, trained_version: int, runtime: Runtime) -> dict[str, float]:
    """How many policy versions the sampled tokens lag the weights that train on them (``trained_version``),
    over the global batch: ``rollout/staleness`` the largest lag of any token, ``rollout/staleness_mean`` the
    mean over tokens (each generated token counts once: observation tokens of multi-turn episodes do not).
    {} when no sample carries its versions (a step on dataset responses); 0 when no token was generated.
    Collective over the replicas."""
    lags = []
    for k, versions in enumerate(rollout.policy_versions):
        mask = rollout.loss_masks[k] if rollout.loss_masks else [1] * len(versions)
        lags += [trained_version - v for v, m in zip(versions, mask) if m]
    samples, tokens, lag_sum = runtime.all_reduce([len(rollout.policy_versions), len(lags), sum(lags)])
    peak = runtime.all_reduce([max(lags, default=0)], op="max")[0]
    if not samples:
        return {}
    return {"rollout/staleness": peak, "rollout/staleness_mean": lag_sum / max(tokens, 1.0)}
