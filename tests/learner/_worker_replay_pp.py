"""One R3 actor update of a tiny Qwen3-MoE (four layers, the first dense) with recomputed activations, in a
pipeline (x tensor) layout, replaying a random routing record; writes the reduced gradients in HF naming.
Usage: _worker_replay_pp.py PP TP MODEL_DIR OUT_DIR

Under pipeline parallelism the 1F1B schedule runs a micro-batch's forward between another's forward and
its recomputing backward, so each backward must route its own micro-batch's record again
(:class:`megarlhf.learner.forward._RouterState`); a 24-token budget gives the schedule several micro-batches.
At TP > 1 the MoE layers run sequence-parallel: rows of an odd token count get a padding segment, whose
router mask the later pipeline stages receive already split over the TP ranks.
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
from _batch import experience, noise, run_config  # noqa: E402
from _worker_moe import capture_gradients, random_routing  # noqa: E402


def main() -> None:
    pp, tp, model_dir, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    out.mkdir(parents=True, exist_ok=True)
    runtime = init_parallel(ParallelConfig(pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp))
    from megarlhf.learner import actor_update, build_actor
    from megarlhf.learner.step import micro_batches_for

    cfg = run_config(model_dir, micro_batch_tokens=24)
    cfg.optim.use_distributed_optimizer = False
    cfg.train.recompute.granularity = "full"
    cfg.algorithm.routing_replay = "r3"
    actor = build_actor(cfg, runtime)
    capture_gradients(actor, out, "replay")
    batch = experience()
    lp0 = torch.zeros(batch.input_ids.shape)
    full = batch.replace(old_logprobs=lp0 + noise(lp0.shape, 1, 0.15) - 5.0,
                         ref_logprobs=lp0 + noise(lp0.shape, 2, 0.3) - 5.0,
                         routed_experts=random_routing(batch, actor.provider))
    metrics = actor_update(actor, full, cfg)
    count = len(micro_batches_for(full.input_ids, full.lengths, full.response_mask, cfg, runtime))
    write_rank_result(out, dist.get_rank(), {"micro_batches": count, **metrics})


if __name__ == "__main__":
    main()
