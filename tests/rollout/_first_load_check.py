"""Script for tests/rollout/test_first_load_report.py: a vLLM engine's report of its first load of the
checkpoint against the report of reloading the same checkpoint from disk (what calibration's bitwise check
compared before the first load was reported).
Usage: _first_load_check.py MODELS_DIR MODEL... -> one JSON line per model (a directory of MODELS_DIR)."""
from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from megarlhf.config.rollout import RolloutConfig
from megarlhf.rollout.engines import EngineConfig, build_engine, vllm_worker
from megarlhf.rollout.engines.sampling import SamplingConfig


def without_time(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "seconds"}


def check(source: Path) -> dict:
    config = EngineConfig.from_rollout(RolloutConfig(kv_cache_mb=64, max_new_tokens=8, backend="vllm"),
                                       model_dtype="float32", seed=0, max_prompt_length=32)
    engine = build_engine(str(source), config, torch.device("cpu"))
    start = time.perf_counter()
    first = engine.checkpoint_report()  # the first load's: no reload
    first_s = time.perf_counter() - start
    reload = engine.checkpoint_report()  # nothing left of the first load: a reload from disk
    fresh = engine.run_in_worker(functools.partial(vllm_worker.reload_checkpoint_and_report, sharded=False))
    # log-probs of sampled and of prompt tokens: vLLM's sampler counts their ranks (compiled, unless on CPU)
    engine.generate([[3, 4, 5]], SamplingConfig(n=2, temperature=1.0, max_new_tokens=4, seed=0))
    engine.prompt_logprobs([[3, 4, 5, 6]])
    return {"compiled_frames": dict(counters["frames"]), "equal": without_time(first) == without_time(reload) == without_time(fresh),
            "first_s": first_s, "parameters": len(first["parameters"]), "processed": len(first["processed"]),
            "problems": first["problems"] + reload["problems"],
            "differ": sorted(k for kind in ("parameters", "processed")
                             for k in set(first[kind]) ^ set(reload[kind])
                             | {n for n in first[kind] if n in reload[kind] and first[kind][n] != reload[kind][n]})}


def main() -> None:
    models = Path(sys.argv[1])
    for name in sys.argv[2:]:
        print(json.dumps({"arch": name, **check(models / name)}), flush=True)


if __name__ == "__main__":
    main()
