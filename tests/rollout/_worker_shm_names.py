"""Rank script for tests/rollout/test_shm_names.py. Usage: _worker_shm_names.py MODEL_DIR OUT_DIR HOLD_FILE

Builds one vLLM engine over both ranks (TP2, the external launcher, on CPU: its collectives go through
shared memory), generates greedily, writes rank<N>.json, then keeps the engine alive until HOLD_FILE is gone
(at most 300 s)."""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from megarlhf.testing.launch import write_rank_result


def main() -> None:
    model_dir, out_dir, hold = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    from megarlhf.config.rollout import RolloutConfig
    from megarlhf.rollout.engines import EngineConfig
    from megarlhf.rollout.engines.sampling import SamplingConfig
    from megarlhf.rollout.engines.vllm import VLLMEngine

    config = EngineConfig.from_rollout(RolloutConfig(kv_cache_mb=32, max_new_tokens=6, tensor_parallel_size=2),
                                       model_dtype="float32", seed=0, max_prompt_length=16)
    engine = VLLMEngine(model_dir, config)
    batch = engine.generate([[3, 4, 5, 6]], SamplingConfig(n=1, temperature=0.0, max_new_tokens=6, ignore_eos=True))
    write_rank_result(out_dir, dist.get_rank(), {"tokens": [list(r) for r in batch.response_ids],
                                                "master_port": os.environ["MASTER_PORT"]})
    deadline = time.time() + 300
    while os.path.exists(hold) and time.time() < deadline:
        time.sleep(0.2)
    dist.barrier()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
