"""One SFT optimizer step: next-token cross-entropy on response tokens, packed, global token mean.

The examples (this data-parallel rank's share of the global batch) are packed into micro-batches under
``train.micro_batch_tokens``; the loss is ``-sum log p(token) / N`` over the tokens whose
``SFTExample.loss_mask`` is 1, with ``N`` counted over every micro-batch of every DP rank, so it is the
token mean over the whole global batch whatever the packing and the DP size. Log-probs come from the
same fused forward as the RL trainer, at temperature 1. ``loss_mask`` is token-aligned (1 on the
tokens to predict); the first token of an example has no prediction and must be 0.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megarlhf.algorithms import aggregate_loss
from megarlhf.config.schema import RunConfig
from megarlhf.learner.batch import ExperienceBatch
from megarlhf.learner.models import TrainModel
from megarlhf.learner.moe_metrics import mean_moe_metrics
from megarlhf.learner.step import PREFIX_TOKENS_SAVED, loss_normaliser, micro_batches_for, optimizer_step


def sft_batch(examples: Sequence, device: torch.device, pad_id: int = 0) -> ExperienceBatch:
    """``SFTExample``s as an :class:`ExperienceBatch` on ``device`` whose response mask is the loss mask."""
    if not examples:
        raise ValueError("sft_batch: no examples")
    width = max(len(e.input_ids) for e in examples)
    ids, mask = [], []
    for i, example in enumerate(examples):
        if len(example.loss_mask) != len(example.input_ids):
            raise ValueError(f"sft_batch: example {i} has {len(example.input_ids)} input_ids but "
                             f"{len(example.loss_mask)} loss_mask entries")
        if example.loss_mask and example.loss_mask[0]:
            raise ValueError(f"sft_batch: example {i} has loss on its first token, which has no prediction")
        pad = width - len(example.input_ids)
        ids.append(list(example.input_ids) + [pad_id] * pad)
        mask.append([bool(m) for m in example.loss_mask] + [False] * pad)
    lengths = [len(e.input_ids) for e in examples]
    return ExperienceBatch(torch.tensor(ids, dtype=torch.long, device=device),
                           torch.tensor(lengths, dtype=torch.long, device=device),
                           torch.tensor(mask, dtype=torch.bool, device=device), host_lengths=tuple(lengths))


def sft_step(actor: TrainModel, examples: Sequence, config: RunConfig, *, on_nonfinite: str = "abort",
             pad_id: int = 0) -> dict[str, float]:
    """One optimizer step on this rank's ``examples``; returns ``sft/loss`` (global token mean),
    ``sft/tokens``, ``sft/grad_norm``, ``sft/lr``, ``sft/skipped_steps`` and
    ``train/shared_prefix_tokens_saved`` (tokens shared prompt prefixes spared), identical on every rank."""
    runtime = actor.runtime
    batch = sft_batch(examples, runtime.device, pad_id)
    normaliser = loss_normaliser(batch.response_mask, runtime)
    factor = float(normaliser.grad_average_factor)

    def loss_fn(mb, out):
        mask = batch.response_mask[mb.rows, :mb.width]
        share = aggregate_loss(-out["logprobs"], mask, "token_mean", normaliser)
        return share, {"loss": share.detach() / factor, "tokens": mask.sum()}  # read once per step

    mbs = micro_batches_for(batch.input_ids, batch.lengths, batch.response_mask, config, runtime)
    result = optimizer_step(actor, mbs, loss_fn, ["loss", "tokens"], loss_name="loss", on_nonfinite=on_nonfinite)
    return {"sft/loss": result.metrics["loss"], "sft/tokens": result.metrics["tokens"],
            "sft/grad_norm": result.grad_norm if result.grad_norm is not None else float("nan"),
            "sft/lr": result.lr, "sft/skipped_steps": float(result.skipped),
            "train/shared_prefix_tokens_saved": result.metrics[PREFIX_TOKENS_SAVED],
            **mean_moe_metrics("sft", [result.moe])}
