"""Rank script for tests/parallel/test_runtime.py: the Runtime against Megatron's parallel state (2 ranks)."""
import sys
import time

from megarlhf.testing.launch import write_rank_result
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_parallel, shutdown


def main() -> None:
    tp, out_dir = int(sys.argv[1]), sys.argv[2]
    runtime = init_parallel(ParallelConfig(tensor_model_parallel_size=tp), seed=1)
    from megatron.core import parallel_state as ps

    rank = runtime.launch.rank
    matches = (runtime.tp.size == ps.get_tensor_model_parallel_world_size()
               and runtime.tp.rank == ps.get_tensor_model_parallel_rank()
               and runtime.dp.size == ps.get_data_parallel_world_size()
               and runtime.dp.rank == ps.get_data_parallel_rank()
               and runtime.dp_cp.size == ps.get_data_parallel_world_size(with_context_parallel=True)
               and runtime.pp.size == 1 and runtime.is_first_stage and runtime.is_last_stage
               and runtime.trainers.size == 2 and runtime.world.size == 2)
    start = time.perf_counter()
    for _ in range(20):
        runtime.all_reduce([1.0], over="world")
    per_call_us = (time.perf_counter() - start) / 20 * 1e6
    write_rank_result(out_dir, rank, {
        "matches_megatron": matches, "dp": [runtime.dp.rank, runtime.dp.size],
        "tp": [runtime.tp.rank, runtime.tp.size], "replica": [runtime.replica.rank, runtime.replica.size],
        "dp_sum": runtime.all_reduce([1.0 + rank, 5.0]), "world_max": runtime.all_reduce([1.0 + rank], "max", "world")[0],
        "any_true": runtime.any_rank(rank == 1), "any_false": runtime.any_rank(False),
        "gathered": runtime.all_gather_objects(rank, over="world"), "device": runtime.device.type,
        "all_reduce_us": per_call_us})
    shutdown()


if __name__ == "__main__":
    main()
