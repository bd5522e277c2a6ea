"""Supervised fine-tuning on the same Megatron models: chat or completion data, loss on response tokens.

Each step draws ``train.global_batch_size`` examples (seeded, resumable, split over data-parallel
replicas) and takes one optimizer step on the global token-mean negative log-likelihood of the
response tokens (:func:`megarlhf.learner.sft_step`). Checkpoints, metrics and the final HF export
work as in the RL driver.
"""
from __future__ import annotations

import time
from pathlib import Path

from megarlhf.config.schema import RunConfig
from megarlhf.data.sft import load_sft_dataset
from megarlhf.run.context import start_run
from megarlhf.run.checkpointer import RunCheckpointer
from megarlhf.learner import build_actor, export_policy, sft_step


def train_sft(config: RunConfig) -> Path:
    """Runs ``config.train.steps`` SFT steps (resuming if asked); returns the exported HF directory."""
    run = start_run(config, "sft")
    dataset = load_sft_dataset(config.data.train_path, run.tokenizer, config.data)
    run.actor = build_actor(config, run.runtime, total_steps=config.train.steps)
    run.checkpointer = RunCheckpointer(config, run.trained_models(), run.command)
    sampler, first_step = run.resume(len(dataset))
    run.open_recorder(first_step, console_keys=("sft/loss", "sft/grad_norm", "sft/lr", "time/step_s"))
    for step in range(first_step, config.train.steps):
        run.checkpointer.poll()  # publishes a background save (checkpoint.async_save) whose write has finished
        start = time.perf_counter()
        examples = [dataset[i] for i in sampler.next_batch()]
        metrics = sft_step(run.actor, examples, config, on_nonfinite=config.train.on_nonfinite, pad_id=run.pad_id)
        metrics["time/step_s"] = time.perf_counter() - start
        run.log_step(step, metrics)
        run.save(step + 1, lambda: {"sampler": sampler.state_dict()})  # checkpoints are named by completed steps
    run.checkpointer.close()
    run.close()
    out = export_policy(run.actor, config, run.run_dir / "hf")
    run.finish(out, ("sft/loss",), what="fine-tuned model")
    return out
