"""Rank script for tests/planner/test_shapes.py: this rank's Megatron parameter count at TP=2 and PP=2."""
import sys

from megatron.core import parallel_state as ps

from megarlhf.testing.launch import write_rank_result
from model_providers.hf_checkpoint import load_hf_model
from parallel.config import ParallelConfig
from parallel.runtime import init_parallel


def main() -> None:
    out_dir, models = sys.argv[1], sys.argv[2:]
    counts = []
    for tp, pp in ((2, 1), (1, 2)):
        ps.destroy_model_parallel()
        launch = init_parallel(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)).launch
        for model_dir in models:
            _, model = load_hf_model(model_dir)
            counts.append({"model": model_dir, "tp": tp, "pp": pp, "stage": ps.get_pipeline_model_parallel_rank(),
                           "params": sum(p.numel() for p in model.parameters())})
    write_rank_result(out_dir, launch.rank, {"counts": counts})


if __name__ == "__main__":
    main()
