"""What the GPU check's tests share: where they run and the small run config they build on."""
from __future__ import annotations

import os
from pathlib import Path

import torch

DRY_RUN = os.environ.get("MEGARLHF_GPU_CHECK_CPU") == "1"  # the check's code paths on CPU, small sizes
ON_GPU = torch.cuda.is_available()


def run_config(model_dir: Path, dtype: str, *overrides: str):
    """A small run config over ``model_dir`` (the loader applies ``overrides``)."""
    from megarlhf.config import RunConfig, load_config

    return load_config(RunConfig, None, [f"model.path={model_dir}", f"model.dtype={dtype}",
                                         "data.train_path=unused.jsonl", "data.max_prompt_length=64",
                                         "rollout.max_new_tokens=64", "train.micro_batch_tokens=1024",
                                         "algorithm.kl_mode=none", *overrides])
