"""Preference training on the same Megatron models: ``megarlhf dpo`` and ``megarlhf rm``.

Both read preference pairs (:mod:`megarlhf.data.preference`; ``data.train_path``, held-out pairs in
``data.eval_path``), draw ``train.global_batch_size`` pairs per step (seeded, resumable, whole pairs per
data-parallel rank) and take one optimizer step per batch (:mod:`megarlhf.learner.preference`).
Checkpoints, resume, metrics and curves work as in SFT; evaluation on the held-out pairs runs every
``eval.every`` steps and at the end (``eval/...`` metrics).

* ``megarlhf dpo``: the actor (``model.path``) on ``preference.loss`` (DPO / cDPO, IPO, SimPO on pairs;
  KTO on unpaired rows ``{prompt, completion, label}``, whose KL rows the data module forms). For a
  loss that needs a reference, the frozen reference (``model.path``) scores each batch and is offloaded
  in between (``preference.precompute_reference=false``), or scores the whole dataset once before
  training and is then dropped (``true``). Exports the policy to ``<run_dir>/hf``.
* ``megarlhf rm``: a value-head model (``model.path``: a causal LM, its head fresh, or an HF
  ``...ForSequenceClassification``) on the Bradley-Terry loss of the scores at each side's last token.
  Exports an HF ``...ForSequenceClassification`` directory to ``<run_dir>/hf`` with
  ``megarlhf_reward_stats.json`` (mean and std of its scores over the training pairs' responses), which
  ``reward.reward_model_normalize`` uses in RL.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from megarlhf.config.schema import RunConfig
from megarlhf.data.preference import PreferenceDataset, UnpairedExample, load_preference_dataset
from megarlhf.core.errors import DataError
from megarlhf.records.metrics import mean_and_std
from megarlhf.rollout.colocate import OffloadedModel
from megarlhf.run.context import RunContext, start_run
from megarlhf.run.checkpointer import RunCheckpointer
from megarlhf.learner import build_actor, build_reference, build_reward_model, export_policy
from megarlhf.learner.preference import (compute_scores, evaluate_pairs, pair_batch, preference_step,
                                          reward_model_step, sequence_logprobs)
from megarlhf.learner.learned_reward import STATS_FILE
from model_providers.value_head import export_reward_model
from megarlhf.algorithms.preference_losses import PREFERENCE_LOSSES



def _load(run, path: str, mode: str) -> PreferenceDataset:
    paired = mode == "rm" or PREFERENCE_LOSSES.get(run.config.preference.loss).paired
    dataset = load_preference_dataset(path, run.tokenizer, run.config.data, run.config.preference.keys, paired)
    if len(dataset) == 0:
        raise DataError(f"{path}: no preference pair is left after dropping {dataset.num_dropped} longer than "
                        f"data.max_sequence_length={run.config.data.max_sequence_length}")
    return dataset


def _reference_scorer(config: RunConfig, runtime, datasets: list[PreferenceDataset], pad_id: int, actor):
    """A function ``(batch, pair indices, dataset) -> [B] reference log-probs`` (None: the loss needs none).
    Precomputed: every dataset is scored once (each DP rank a share, then gathered) and the model dropped;
    otherwise the model stays and is offloaded between uses (a LoRA reference is the actor's own base:
    nothing to offload)."""
    if not PREFERENCE_LOSSES.get(config.preference.loss).needs_reference:
        return None
    reference = build_reference(config, runtime, actor)
    if config.preference.precompute_reference:
        return _precomputed_scorer(reference, config, runtime, datasets, pad_id)
    if reference.shares_actor:
        return lambda batch, indices, dataset: sequence_logprobs(reference, batch, config)
    offloaded = OffloadedModel.of(reference)

    def on_the_fly(batch, indices, dataset):
        if offloaded.params_offloaded:
            offloaded.onload()
        scores = sequence_logprobs(reference, batch, config)
        offloaded.offload()
        return scores
    return on_the_fly


def _precomputed_scorer(reference, config: RunConfig, runtime, datasets: list[PreferenceDataset], pad_id: int):
    tables = {}
    for dataset in datasets:
        mine = list(range(runtime.dp.rank, len(dataset), runtime.dp.size))
        local = {}
        for start in range(0, len(mine), config.train.global_batch_size):
            chunk = mine[start:start + config.train.global_batch_size]
            logps = sequence_logprobs(reference, pair_batch([dataset[i] for i in chunk], runtime.device, pad_id),
                                      config).tolist()
            local.update({i: (logps[2 * k], logps[2 * k + 1]) for k, i in enumerate(chunk)})
        tables[id(dataset)] = {i: v for part in runtime.all_gather_objects(local, over="dp") for i, v in part.items()}

    def precomputed(batch, indices, dataset):
        values = [v for i in indices for v in tables[id(dataset)][i]]
        return torch.tensor(values, dtype=torch.float32, device=runtime.device)
    return precomputed


def _desirable(dataset: PreferenceDataset, indices, device) -> torch.Tensor | None:
    """The labels [P] of unpaired examples (None for pairs)."""
    if not isinstance(dataset[0], UnpairedExample):
        return None
    return torch.tensor([dataset[i].desirable for i in indices], dtype=torch.bool, device=device)


def _run_pairs(config: RunConfig, mode: str) -> Path:
    run = start_run(config, mode)
    runtime = run.runtime
    train = _load(run, config.data.train_path, mode)
    held_out = _load(run, config.data.eval_path, mode) if config.data.eval_path else None
    reference = None
    if mode == "dpo":
        run.actor = build_actor(config, runtime, total_steps=config.train.steps)
        reference = _reference_scorer(config, runtime, [d for d in (train, held_out) if d is not None], run.pad_id,
                                      run.actor)
    else:
        run.actor = build_reward_model(config, runtime, config.model.path, total_steps=config.train.steps)
    run.checkpointer = RunCheckpointer(config, run.trained_models(), run.command)
    sampler, first_step = run.resume(len(train))
    keys = _console_keys(config, mode)
    run.open_recorder(first_step, console_keys=(*keys, "eval/" + keys[1], "time/step_s"))
    for step in range(first_step, config.train.steps):
        run.checkpointer.poll()  # publishes a background save (checkpoint.async_save) whose write has finished
        start = time.perf_counter()
        metrics = _evaluate_pairs(run, held_out, reference, step)
        metrics.update(_pair_step(run, mode, train, sampler.next_batch(), reference))
        metrics["time/step_s"] = time.perf_counter() - start
        run.log_step(step, metrics)
        run.save(step + 1, lambda: {"sampler": sampler.state_dict()})
    run.checkpointer.close()
    if held_out is not None and config.eval.every:  # also after resuming a finished run (as in rl.py)
        run.log_step(config.train.steps, _evaluate_pairs(run, held_out, reference, config.train.steps))
    run.close()
    out = run.run_dir / "hf"
    if mode == "dpo":
        export_policy(run.actor, config, out)
    else:
        stats = _score_stats(run.actor, train, config, runtime, run.pad_id)
        export_reward_model(run.actor.model, run.actor.provider, out, source_dir=config.model.path, overwrite=True)
        if run.is_main:
            (out / STATS_FILE).write_text(json.dumps(stats, indent=1) + "\n")
    run.finish(out, keys, what="policy" if mode == "dpo" else "reward model")
    return out


def _console_keys(config: RunConfig, mode: str) -> tuple[str, ...]:
    if mode == "rm":
        return "rm/loss", "rm/accuracy"
    if PREFERENCE_LOSSES.get(config.preference.loss).paired:
        return "dpo/loss", "rewards/accuracy", "rewards/margin"
    return "dpo/loss", "rewards/chosen", "rewards/rejected", "kto/kl"


def _pair_step(run: RunContext, mode: str, train: PreferenceDataset, indices: list[int], reference
               ) -> dict[str, float]:
    """One optimizer step on the step's pairs (this replica's share of ``indices``)."""
    config, runtime = run.config, run.runtime
    share = config.train.global_batch_size // runtime.dp.size
    batch = pair_batch([train[i] for i in indices], runtime.device, run.pad_id, first_pair=runtime.dp.rank * share)
    if mode == "rm":
        return reward_model_step(run.actor, batch, config, on_nonfinite=config.train.on_nonfinite)
    ref = reference(batch, indices, train) if reference is not None else None
    return preference_step(run.actor, batch, config, ref, desirable=_desirable(train, indices, runtime.device),
                           on_nonfinite=config.train.on_nonfinite)


def _evaluate_pairs(run: RunContext, held_out: PreferenceDataset | None, reference, step: int) -> dict[str, float]:
    """``eval/...`` on the held-out pairs when ``eval.every`` asks for it (and at the last step)."""
    config, runtime = run.config, run.runtime
    every, steps = config.eval.every, config.train.steps
    if held_out is None or not every or (step % every and step != steps):
        return {}
    indices = list(range(runtime.dp.rank, len(held_out), runtime.dp.size))  # may be empty: still takes part
    batch = pair_batch([held_out[i] for i in indices], runtime.device, run.pad_id) if indices else None
    ref = reference(batch, indices, held_out) if reference is not None and indices else None
    labels = _desirable(held_out, indices, runtime.device) if indices else None
    return {f"eval/{k}": v for k, v in evaluate_pairs(run.actor, batch, config, ref, labels).items()}


def _score_stats(model, dataset: PreferenceDataset, config: RunConfig, runtime, pad_id: int) -> dict[str, float]:
    """Mean and std of the reward model's scores over the responses (both sides) of the training pairs."""
    mine = list(range(runtime.dp.rank, len(dataset), runtime.dp.size))
    total = [0.0, 0.0, 0.0]  # count, sum, sum of squares
    for start in range(0, len(mine), config.train.global_batch_size):
        chunk = [dataset[i] for i in mine[start:start + config.train.global_batch_size]]
        scores = compute_scores(model, pair_batch(chunk, runtime.device, pad_id), config).double()
        total = [total[0] + scores.numel(), total[1] + float(scores.sum()), total[2] + float((scores ** 2).sum())]
    count, s, sq = runtime.all_reduce(total)
    mean, std = mean_and_std(count, s, sq)
    return {"mean": mean, "std": std, "responses": count}


def train_dpo(config: RunConfig) -> Path:
    """Runs ``config.train.steps`` DPO-family steps (resuming if asked); returns the exported policy."""
    return _run_pairs(config, "dpo")


def train_rm(config: RunConfig) -> Path:
    """Trains a reward model for ``config.train.steps`` steps; returns the exported HF directory."""
    return _run_pairs(config, "rm")
