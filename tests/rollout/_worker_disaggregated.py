"""Rank script for the disaggregated rollout tests. Usage: _worker_disaggregated.py NUM_ENGINE_RANKS MODEL_DIR OUT

Trainer ranks [0, W-E) hold the tiny model in Megatron (TP=1, DP = W-E); engine ranks [W-E, W) hold one
out-of-process vLLM engine each and serve. The trainers record
* the verified sync metrics (sync0 before training, sync1 after 3 AdamW steps);
* greedy generations from the engines vs the trainer's own greedy decoding, and the engines' sampled-
  token log-probs vs trainer teacher forcing (the training forward), before and after training;
* seeded sampling asked twice;
* the message of a third sync whose bucket is perturbed by one ulp on the engine side (after the
  trainer's fingerprint, before vLLM's loader), which must stop trainers and engines alike.
Engine ranks record what Megatron set up on them and the error their ``serve`` loop stopped with.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from _worker_rollout import NEW_TOKENS, prompts, run_config, train_with, trainer_greedy, trainer_logprobs
from megarlhf.testing.launch import write_rank_result
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_disaggregated

TARGET = "model.layers.1.mlp.down_proj.weight"


def generate(rollout, prompt_list, sampling):
    return rollout.receive(rollout.launch(prompt_list, sampling))[0]


def compare(rollout, actor, config, prompt_list, seed: int) -> dict:
    """Engine rollouts of this replica's prompts vs the trainer's greedy decoding and teacher forcing."""
    from megarlhf.rollout.engines.sampling import SamplingConfig

    model, vocab = actor.model, actor.provider.hf_config.vocab_size
    greedy = generate(rollout, prompt_list, SamplingConfig(n=1, temperature=0.0, max_new_tokens=NEW_TOKENS,
                                                          ignore_eos=True))
    reference = trainer_greedy(model, prompt_list, vocab)
    sampled = generate(rollout, prompt_list, SamplingConfig(n=2, temperature=1.0, max_new_tokens=NEW_TOKENS,
                                                           seed=seed))
    sequences = [p + r for p, r in zip(sampled.prompt_ids, sampled.response_ids)]
    trainer_lp = trainer_logprobs(actor, config, sequences)
    diffs = [abs(t - e) for tl, lp in zip(trainer_lp, sampled.logprobs) for t, e in zip(tl[-len(lp):], lp)]
    return {"greedy_prompt_index": greedy.prompt_index, "trainer_greedy": reference,
            "greedy_equal": sum(r == reference[i] for i, r in zip(greedy.prompt_index, greedy.response_ids)),
            "sampled_prompt_index": sampled.prompt_index, "sampled_tokens": len(diffs),
            "logprob_max_diff": max(diffs), "greedy_finish": sorted(set(greedy.finish_reasons))}


def trainer(rollout, actor, config, dp_rank: int, dp_size: int) -> dict:
    from megarlhf.rollout.engines.sampling import SamplingConfig
    from megarlhf.rollout.sync.weights import WeightSyncError

    model, provider = actor.model, actor.provider
    everything = prompts(provider.hf_config.vocab_size)
    mine = everything[dp_rank::dp_size]
    result = {"calibration": rollout.calibrate(everything[:2], ()), "sync0": rollout.sync()}
    result["before"] = compare(rollout, actor, config, mine, seed=3)
    result["losses"] = train_with(model, provider, torch.optim.AdamW(model.parameters(), lr=3e-3), steps=3)
    result["sync1"] = rollout.sync()
    result["after"] = compare(rollout, actor, config, mine, seed=4)
    cfg = SamplingConfig(n=3, temperature=0.9, max_new_tokens=12, seed=77)
    a, b = generate(rollout, mine[:8], cfg), generate(rollout, mine[:8], cfg)
    result["seeded_equal"] = a.response_ids == b.response_ids and a.logprobs == b.logprobs
    result["seeded_prompt_index"] = a.prompt_index
    train_with(model, provider, torch.optim.AdamW(model.parameters(), lr=3e-3), steps=1)  # weights to send
    try:
        rollout.sync()  # the engines corrupt this one
        result["corrupted"] = None
    except WeightSyncError as err:
        result["corrupted"] = str(err)
    return result


def engine(server) -> dict:
    """Serves; the second sync it receives (the trainers' third: their first sent nothing) has one tensor
    perturbed by one ulp on its way into vLLM."""
    from megatron.core import parallel_state as ps
    from megarlhf.rollout.engines import WeightBucket
    from megarlhf.rollout.engines.shared_tensor import shared_buffer
    from megarlhf.rollout.sync.weights import WeightSyncError

    result = {"megatron_initialized": ps.model_parallel_is_initialized()}
    real_sync, real_load, syncs = server.handlers["sync"], server.engine.load_bucket, []

    def perturbing_load(bucket):
        offset, payload = 0, bucket.payload
        for name, dtype, shape, nbytes in bucket.meta:
            if name == TARGET:  # a copy, in shared memory as the engine rank's buffers are
                payload = shared_buffer(payload.numel(), payload.device).copy_(payload)
                value = payload[offset:offset + nbytes].view(torch.float32)
                value[7] = torch.nextafter(value[7], torch.tensor(float("inf")))
            offset += nbytes
        return real_load(WeightBucket(bucket.meta, payload))

    def counting_sync():
        syncs.append(1)
        if len(syncs) == 2:
            server.engine.load_bucket = perturbing_load
        real_sync()

    server.handlers["sync"] = counting_sync
    try:
        server.serve()
        result["serve_error"] = None
    except WeightSyncError as err:
        result["serve_error"] = str(err)
    result["syncs_served"] = len(syncs)
    return result


def main() -> None:
    num_engines, model_dir, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    runtime = init_disaggregated(ParallelConfig(), num_trainer_ranks=world - num_engines, seed=1234)
    from megarlhf.config.rollout import RolloutPlacementConfig
    from megarlhf.learner import TrainModel
    from megarlhf.rollout.disaggregated.engine_side import EngineServer
    from megarlhf.rollout.disaggregated.protocol import Channel
    from megarlhf.rollout.disaggregated.trainer_side import RemoteEngines
    from megarlhf.rollout.engines import build_engine
    from megarlhf.rollout.phase import engine_config
    from model_providers.hf_checkpoint import load_hf_model

    config = run_config(model_dir, 1)
    config.rollout.placement = RolloutPlacementConfig(mode="disaggregated", num_engine_ranks=num_engines)
    channel = Channel(runtime, world - num_engines)
    if runtime.is_engine_rank:
        engine_rank = build_engine(model_dir, engine_config(config, in_process=False), runtime.device)
        result = engine(EngineServer(channel, engine_rank))
    else:
        provider, model = load_hf_model(model_dir, packed_sequences=True)
        actor = TrainModel("actor", model, provider, runtime)
        result = trainer(RemoteEngines(config, channel, actor), actor, config, runtime.dp.rank, runtime.dp.size)
        result["tp_world"], result["dp_world"] = runtime.tp.size, runtime.dp.size
    write_rank_result(out_dir, dist.get_rank(), result)


if __name__ == "__main__":
    main()
