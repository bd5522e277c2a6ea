"""Counts the host synchronisations of the trainer's part of one RL step (single rank, CPU).

Also counts, apart, a GRPO actor update whose old log-probs come from its own forward and are corrected
for the rollout's log-probs (truncated IS weights per micro-batch), the default GRPO path.
Usage: _worker_host_syncs.py WORK_DIR OUT_DIR

Every host synchronisation (:mod:`megarlhf.records.host_syncs`: scalar reads, data-dependent ops,
host <-> device copies) is counted while one step runs: the actor's and the reference's scoring, the
critic's values, one actor update and one critic update (PPO with a KL loss and an entropy bonus). The
step runs at two model sizes (2 layers / hidden 64 and 4 layers / hidden 128) and two micro-batch budgets
(one micro-batch per pass and five, which also changes the number of packed segments per
micro-batch), with shared prompt prefixes on. Records the count of each run and which calls they were.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from megarlhf.records.host_syncs import HostSyncCounter as HostReadCounter  # noqa: E402
from megarlhf.testing.launch import write_rank_result
from model_providers.tiny_models import make_tiny_model
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_parallel

sys.path.insert(0, str(Path(__file__).parent))
from _batch import VOCAB, experience, run_config  # noqa: E402

SIZES = {"small": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128),
         "large": dict(num_hidden_layers=4, hidden_size=128, intermediate_size=256)}
BUDGETS = {"one_micro_batch": 4096, "five_micro_batches": 24}


def one_step(model_dir: Path, budget: int, runtime) -> dict:
    from megarlhf.learner import (actor_update, build_actor, build_critic, build_frozen, compute_logprobs,
                                   compute_values, critic_update)

    config = run_config(str(model_dir), str(model_dir), micro_batch_tokens=budget)
    config.optim.clip_grad = 1.0
    actor, reference = build_actor(config, runtime), build_frozen(config, runtime, "reference")
    critic = build_critic(config, runtime)
    batch = experience(VOCAB)
    with HostReadCounter() as counter:
        old = compute_logprobs(actor, batch, config)
        ref = compute_logprobs(reference, batch, config)
        values = compute_values(critic, batch, config)
        batch = batch.replace(old_logprobs=old, ref_logprobs=ref, values=values)
        actor_update(actor, batch, config)
        critic_update(critic, batch, config)
    # GRPO's default path: the old log-probs come from the update's own forward, which corrects each
    # micro-batch for the rollout engine's log-probs (token-level TIS)
    grpo = batch.replace(old_logprobs=None, values=None, rollout_logprobs=old + 0.01 * torch.randn_like(old))
    with HostReadCounter() as grpo_counter:
        actor_update(actor, grpo, config)
    from megarlhf.learner.step import micro_batches_for

    mbs = micro_batches_for(batch.input_ids, batch.lengths, batch.response_mask, config, runtime)
    return {"count": counter.count, "where": dict(counter.where), "host_steps": sum(counter.host_steps.values()),
            "grpo_count": grpo_counter.count, "grpo_where": dict(grpo_counter.where),
            "host_step_sites": sorted(counter.host_steps), "micro_batches": len(mbs),
            "segments": sum(len(mb.packed_seq_params.cu_seqlens_q) - 1 for mb in mbs)}


def main() -> None:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    runtime = init_parallel(ParallelConfig())
    results = {}
    for size, shape in SIZES.items():
        model_dir = make_tiny_model("llama", work / size, seed=0, **shape)
        for name, budget in BUDGETS.items():
            results[f"{size}/{name}"] = one_step(model_dir, budget, runtime)
    write_rank_result(out, runtime.launch.rank, results)


if __name__ == "__main__":
    main()
