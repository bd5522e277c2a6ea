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
from megarlhf.records.metrics import plot_curves
from megarlhf.run.context import start_run
from megarlhf.run.checkpointer import RunCheckpointer
from megarlhf.learner import build_actor, export_policy, sft_step


def train_sft(config: RunConfig) -> Path:
    """Runs ``config.train.steps`` SFT steps (resuming if asked); returns the exported HF directory."""
    run = start_run(config)
    dataset = load_sft_dataset(config.data.train_path, run.tokenizer, config.data)
    steps = config.train.steps
    actor = build_actor(config, run.runtime, total_steps=steps)
    checkpointer = RunCheckpointer(config, {"actor": actor})
    sampler, first_step = run.resume(checkpointer, len(dataset))
    recorder = run.open_recorder(steps, first_step,
                                 console_keys=("sft/loss", "sft/grad_norm", "sft/lr", "time/step_s"))
    for step in range(first_step, steps):
        checkpointer.poll()  # publishes a background save (checkpoint.async_save) whose write has finished
        start = time.perf_counter()
        examples = [dataset[i] for i in sampler.next_batch()]
        metrics = sft_step(actor, examples, config, on_nonfinite=config.train.on_nonfinite, pad_id=run.pad_id)
        metrics["time/step_s"] = time.perf_counter() - start
        recorder.log(step, metrics)
        if checkpointer.should_save(step + 1, steps):  # checkpoints are named by completed steps
            checkpointer.save(step + 1, {"step": step + 1, "sampler": sampler.state_dict()})
    checkpointer.close()
    recorder.close()
    export_dir = export_policy(actor, config, run.run_dir / "hf")
    if run.is_main:
        plot_curves(run.run_dir / "metrics.jsonl", run.run_dir / "curves.png", keys=("sft/loss",))
    run.log(f"exported the fine-tuned model to {export_dir}")
    return export_dir
