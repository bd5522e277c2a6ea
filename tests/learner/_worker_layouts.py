"""Two-rank run of one actor update and one critic update in one (TP, CP, PP) layout (issue 7's
loss-invariance check). Usage: _worker_layouts.py TP CP PP MODEL_DIR CRITIC_DIR OUT_DIR

The batch, its GRPO advantages, old / reference / rollout log-probs and old values are the same in every
layout (computed with HF transformers on every rank, plus fixed noise); with DP=2 (TP=CP=PP=1) each DP
rank takes every other sequence, so the global batch is unchanged. Records, on every rank: the actor's
loss terms and gradient norm, the critic's value loss and gradient norm, and the largest difference of
the trainer's forward log-probs / values from HF's on this rank's sequences.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megarlhf.testing.launch import write_rank_result
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_parallel

sys.path.insert(0, str(Path(__file__).parent))
from _batch import experience, hf_logprobs, hf_values, noise, run_config  # noqa: E402

TEMPERATURE = 0.8


def main() -> None:
    tp, cp, pp = (int(x) for x in sys.argv[1:4])
    model_dir, critic_dir, out_dir = sys.argv[4:7]
    runtime = init_parallel(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                           context_parallel_size=cp))
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from megarlhf.learner import actor_update, build_actor, build_critic, compute_logprobs, compute_values, \
        critic_update

    cfg = run_config(model_dir, critic_dir)
    batch = experience()
    with torch.no_grad():
        lp0 = hf_logprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), batch.input_ids,
                          TEMPERATURE)[0]
        v0 = hf_values(AutoModelForSequenceClassification.from_pretrained(critic_dir, dtype=torch.float32),
                       batch.input_ids)
    old = lp0 + noise(lp0.shape, 1, 0.15)
    batch = batch.replace(old_logprobs=old, ref_logprobs=lp0 + noise(lp0.shape, 2, 0.3),
                          rollout_logprobs=old + noise(lp0.shape, 3, 0.4), values=v0 + noise(v0.shape, 4, 0.3),
                          returns=batch.returns + noise(v0.shape, 5, 0.2))
    dp, dp_rank = runtime.dp.size, runtime.dp.rank
    rows = torch.arange(batch.batch_size)[dp_rank::dp]
    local = batch.select(rows)
    mask = local.response_mask

    actor = build_actor(cfg, runtime)
    lp = compute_logprobs(actor, local, cfg)
    actor_metrics = actor_update(actor, local, cfg)
    critic = build_critic(cfg, runtime)
    values = compute_values(critic, local, cfg)
    critic_metrics = critic_update(critic, local, cfg)
    result = {
        "rank": dist.get_rank(), "dp": dp,
        "logprobs_vs_hf": float((lp - lp0[rows, :lp.shape[1]])[mask].abs().max()),
        "values_vs_hf": float((values - v0[rows, :values.shape[1]])[mask].abs().max()),
        "value_scale": float(v0[batch.response_mask].abs().max()),
        **{k: v for k, v in actor_metrics.items()}, **{k: v for k, v in critic_metrics.items()},
    }
    write_rank_result(out_dir, dist.get_rank(), result)


if __name__ == "__main__":
    main()
