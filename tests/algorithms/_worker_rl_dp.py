"""Rank script for tests/algorithms/test_aggregation.py: loss shares, gradients and whitening on 2
data-parallel ranks (gloo) with unequal token counts per rank. Writes its results as JSON."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from _rl_dp_batch import initial_theta, micro_batches, per_token_loss
from megarlhf.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, aggregate_loss, compute_normaliser
from megarlhf.config.algorithm import AGGREGATION_MODES, AdvantageConfig
from megarlhf.testing.launch import write_rank_result

MAX_RESPONSE_LENGTH = 8


def main(out_dir: str) -> None:
    # Plain gloo from torchrun's env: these numerics need no Megatron, and parallel.runtime's
    # init_distributed would import Megatron-Core (its CPU layer), ~10 s per rank on a busy machine.
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    group = dist.group.WORLD
    batches = micro_batches(rank)
    normaliser = compute_normaliser([b["mask"] for b in batches], group, MAX_RESPONSE_LENGTH)
    result = {"num_tokens": normaliser.num_tokens, "num_sequences": normaliser.num_sequences,
              "factor": normaliser.grad_average_factor, "modes": {}}
    for mode in AGGREGATION_MODES:
        theta = initial_theta().requires_grad_(True)
        share_sum = torch.zeros((), dtype=torch.float64)
        for batch in batches:
            share = aggregate_loss(per_token_loss(theta, batch["x"]), batch["mask"], mode, normaliser)
            share.backward()  # gradients accumulate over micro-batches, as in a training step
            share_sum += share.detach()
        grad = theta.grad.clone()
        # What Megatron DDP does with calculate_per_token_loss=False: sum over DP, times 1/dp_size.
        dist.all_reduce(grad, group=group)
        grad /= dist.get_world_size(group)
        dist.all_reduce(share_sum, group=group)
        result["modes"][mode] = {"loss": share_sum.item() / normaliser.grad_average_factor,
                                 "grad": grad.tolist()}
    config = AdvantageConfig(gamma=0.9, lam=0.8)
    inputs = AdvantageInputs(rewards=torch.cat([b["rewards"] for b in batches]),
                             response_mask=torch.cat([b["mask"] for b in batches]),
                             values=torch.cat([b["values"] for b in batches]))
    for name in ("reinforce_pp", "gae"):
        out = ADVANTAGE_ESTIMATORS.get(name)(inputs, config, dp_group=group)
        result[name] = out.advantages.tolist()
    write_rank_result(out_dir, rank, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
