"""Rank script for tests/planner/test_shapes.py: this rank's Megatron parameter count at TP=2, PP=2 and (for
mixture-of-experts models) EP=2, and its routed experts' share."""
import sys

from megatron.core import parallel_state as ps

from megarlhf.testing.launch import write_rank_result
from model_providers.hf_checkpoint import load_hf_model
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_parallel


def main() -> None:
    out_dir, models = sys.argv[1], sys.argv[2:]
    counts = []
    for tp, pp, ep in ((2, 1, 1), (1, 2, 1), (1, 1, 2)):
        ps.destroy_model_parallel()
        launch = init_parallel(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                              expert_model_parallel_size=ep)).launch
        for model_dir in models:
            provider, model = (None, None) if ep > 1 and "moe" not in model_dir else load_hf_model(model_dir)
            if model is None:
                continue
            counts.append({"model": model_dir, "tp": tp, "pp": pp, "ep": ep, "stage": ps.get_pipeline_model_parallel_rank(),
                           "params": sum(p.numel() for p in model.parameters()),
                           "experts": sum(p.numel() for n, p in model.named_parameters() if ".local_experts." in n)})
    write_rank_result(out_dir, launch.rank, {"counts": counts})


if __name__ == "__main__":
    main()
