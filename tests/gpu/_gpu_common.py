"""What the GPU check's tests share: where they run and the small run config they build on."""
from __future__ import annotations

import os
from pathlib import Path

import torch

DRY_RUN = os.environ.get("MEGARLHF_GPU_CHECK_CPU") == "1"  # the check's code paths on CPU, small sizes
ON_GPU = torch.cuda.is_available()


def sft_examples(vocab: int, lengths: tuple[int, ...], prompt_tokens: int, seed: int) -> list:
    """Random SFT rows of ``lengths`` tokens, the first ``prompt_tokens`` of each masked out of the loss."""
    from megarlhf.data.sft import SFTExample

    gen = torch.Generator().manual_seed(seed)
    return [SFTExample(torch.randint(0, vocab, (n,), generator=gen).tolist(),
                       [0] * prompt_tokens + [1] * (n - prompt_tokens)) for n in lengths]


def run_config(model_dir: Path, dtype: str, *overrides: str):
    """A small run config over ``model_dir`` (the loader applies ``overrides``)."""
    from megarlhf.config import RunConfig, load_config

    return load_config(RunConfig, None, [f"model.path={model_dir}", f"model.dtype={dtype}",
                                         "data.train_path=unused.jsonl", "data.max_prompt_length=64",
                                         "rollout.max_new_tokens=64", "train.micro_batch_tokens=1024",
                                         "algorithm.kl_mode=none", *overrides])


def run_rl(tiny_llama, task, tmp_path, *overrides):
    """A 3-step RL run of the real driver with the transformers engine; its metrics records."""
    from megarlhf.config import RunConfig, load_config
    from megarlhf.records.metrics import read_metrics
    from megarlhf.loops.rl import train_rl

    config = load_config(RunConfig, None, [
        f"model.path={tiny_llama}", f"data.train_path={task / 'train.jsonl'}", "data.chat_template=never",
        "data.max_prompt_length=96", "rollout.backend=hf", "rollout.n_samples=4", "rollout.max_new_tokens=32",
        "train.steps=3", "train.global_batch_size=8", "train.micro_batch_tokens=2048", "optim.lr=1e-4",
        "reward.functions=[{name: exact_match}]", "checkpoint.every=0", f"logging.run_dir={tmp_path / 'run'}",
        "logging.backends=[]", *overrides])
    train_rl(config)
    return read_metrics(tmp_path / "run" / "metrics.jsonl")
