"""The one forward of the trainer: per-token log-probs (+ entropy) or values over micro-batches.

Every micro-batch goes through Megatron's ``get_forward_backward_func`` (so tensor, pipeline and context
parallelism work unchanged). On the last pipeline stage GPTModel's ``output_processor`` hook receives
the final hidden states and computes, only at the positions the micro-batch wants:

* ``logprobs`` models: log-probs of the next token (and its entropy) with the fused vocab-parallel op
  (:func:`megarlhf.ops.logprob_entropy`); the [tokens x vocab] logits are never built. Megatron's padded
  vocabulary rows are removed from the softmax with the rollout scorer's helper
  (:func:`megarlhf.rollout.logprobs._mask_padded_vocab`), so these log-probs are HF's and vLLM's.
* ``values`` models (value head, :mod:`model_providers.value_head`): the head's scalar per position.

The per-position outputs are put back in the experience's token-aligned [n, L] layout by
:meth:`MicroBatch.to_rows` (autograd-aware, so a loss computed there trains the model), then either
handed to a loss function (training; :mod:`megarlhf.training.step`) or collected (forward-only;
:func:`forward_only` returns [B, L] tensors on every rank).

Hand-written because the hook, the padded-vocab handling and the token-aligned layout are the project's
own plumbing around Megatron's schedule; it generalises ``megarlhf.rollout.logprobs.token_logprobs``.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from megarlhf.ops import logprob_entropy
from megarlhf.rollout.logprobs import _mask_padded_vocab
from megarlhf.training.packing import MicroBatch

OUTPUT_KINDS = ("logprobs", "values")


def _processor(kind: str, mb: MicroBatch, vocab_size: int, temperature: float, entropy: bool):
    """A GPTModel ``output_processor``: hidden [S, b, H] -> {name: [b, S] fp32} at the wanted positions."""
    from megatron.core import parallel_state as ps

    mask = mb.label_mask.reshape(-1)

    def logprobs(*, hidden_states, output_layer, output_weight, **_):
        weight = output_weight if output_weight is not None else output_layer.weight
        s, b, h = hidden_states.shape
        hidden = hidden_states.transpose(0, 1).reshape(b * s, h)
        tp_size = ps.get_tensor_model_parallel_world_size()
        if weight.shape[0] * tp_size > vocab_size:
            hidden, weight = _mask_padded_vocab(hidden, weight, vocab_size, ps.get_tensor_model_parallel_rank())
        lp, ent = logprob_entropy(hidden, weight, mb.labels.reshape(-1), mask,
                                  tp_group=ps.get_tensor_model_parallel_group() if tp_size > 1 else None,
                                  temperature=temperature, compute_entropy=entropy)
        out = {"logprobs": lp.view(b, s)}
        if entropy:
            out["entropy"] = ent.view(b, s)
        return out

    def values(*, hidden_states, output_layer, **_):
        v = output_layer(hidden_states)[0].squeeze(-1).transpose(0, 1).float()  # [b, S]
        return {"values": torch.where(mb.label_mask, v, torch.zeros((), dtype=v.dtype))}

    return {"logprobs": logprobs, "values": values}[kind]


LossFn = Callable[[MicroBatch, dict], tuple[Tensor, dict]]


def run_schedule(model: torch.nn.Module, micro_batches: list[MicroBatch], *, kind: str, vocab_size: int,
                 temperature: float = 1.0, entropy: bool = False, loss_fn: LossFn | None = None) -> list:
    """Runs ``micro_batches`` through Megatron's schedule; forward-only when ``loss_fn`` is None.

    Forward-only: returns, on the last pipeline stage, one ``{name: [n, width]}`` dict per micro-batch
    (nothing elsewhere). Training: ``loss_fn(mb, outputs) -> (share, metrics)`` per micro-batch, where
    ``share`` is the micro-batch's exact share of the loss to backpropagate; Megatron's 3-tuple loss
    form with ``calculate_per_token_loss=False`` divides it by ``num_tokens`` (passed as 1) and by the
    number of micro-batches, which is undone here, so the gradient is exactly that of the sum of the
    shares (before DDP's average over data-parallel x context-parallel ranks). Returns the metrics dicts (last stage).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if kind not in OUTPUT_KINDS:
        raise ValueError(f"run_schedule: kind must be one of {OUTPUT_KINDS}, got {kind!r}")
    if not micro_batches:
        raise ValueError("run_schedule: no micro-batches")
    count = len(micro_batches)

    def step(data_iterator, chunk):
        mb = next(data_iterator)
        output = chunk(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params,
                       output_processor=_processor(kind, mb, vocab_size, temperature, entropy))

        def finish(output_tensor, non_loss_data=False):
            rows = {name: mb.to_rows(value) for name, value in output_tensor.items()}
            if loss_fn is None:
                return {name: value.detach() for name, value in rows.items()}
            share, metrics = loss_fn(mb, rows)
            return share * count, torch.ones((), dtype=torch.int), metrics

        return output, finish

    longest = max(int(mb.tokens.shape[-1]) for mb in micro_batches)
    return get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter(micro_batches), model=[model], num_microbatches=count,
        seq_length=longest, micro_batch_size=max(int(mb.tokens.shape[0]) for mb in micro_batches),
        forward_only=loss_fn is None, collect_non_loss_data=loss_fn is None)


def broadcast_from_last_stage(tensor: Tensor) -> Tensor:
    """``tensor`` as the last pipeline stage holds it, on every stage (in place; same shape everywhere)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_pipeline_model_parallel_group()
        last = dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
        dist.broadcast(tensor, src=last, group=group)
    return tensor


@torch.no_grad()
def forward_only(model: torch.nn.Module, micro_batches: list[MicroBatch], batch_shape: tuple[int, int], *,
                 kind: str, vocab_size: int, temperature: float = 1.0, entropy: bool = False) -> dict[str, Tensor]:
    """Per-token outputs of a whole batch, [B, L] fp32 each, token-aligned, identical on every rank.

    The model is put in eval mode for the pass and restored after.
    """
    was_training = model.training
    model.eval()
    try:
        results = run_schedule(model, micro_batches, kind=kind, vocab_size=vocab_size,
                               temperature=temperature, entropy=entropy)
    finally:
        model.train(was_training)
    from megatron.core import parallel_state as ps

    names = ["values"] if kind == "values" else ["logprobs"] + (["entropy"] if entropy else [])
    out = {name: torch.zeros(batch_shape, dtype=torch.float32) for name in names}
    if ps.is_pipeline_last_stage():
        for mb, rows in zip(micro_batches, results):
            for name in names:
                out[name][mb.rows, :mb.width] = rows[name].float()
    return {name: broadcast_from_last_stage(value) for name, value in out.items()}
