"""Trainer-side token log-probs of given sequences: teacher forcing through the Megatron model.

:func:`token_logprobs` runs this rank's GPTModel stage through Megatron's forward-only schedule (so
pipeline parallelism works; with PP=1 it is a plain forward), intercepts the final hidden states with
GPTModel's ``output_processor`` hook (the [tokens x vocab] logits are never built) and computes
``log p(x_t | x_<t)`` with the fused vocab-parallel op (:mod:`megarlhf.ops`). The result, [B, S-1]
fp32, is broadcast from the last pipeline stage so every rank holds it.

Padded vocabulary: Megatron pads the vocab to a multiple of 128 x TP; the padded rows of the output
weight would add ``exp(logit)`` terms that HF and vLLM do not have. When padding exists the op gets an
extra hidden column of ones and a matching weight column that is 0 for real rows and -1e30 for padded
ones, so padded logits vanish from the softmax exactly.

Hand-written because Megatron's own log-prob paths build the full logits, and the schedule plumbing
(hook, PP broadcast, padding) is specific to how megarlhf compares trainer and rollout log-probs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarlhf.ops import logprob_entropy

PADDED_LOGIT = -1.0e30


def _mask_padded_vocab(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp_rank: int):
    """Appends the (ones, 0 / PADDED_LOGIT) column pair that removes padded vocab rows from the softmax."""
    v_local = weight.shape[0]
    rows = torch.arange(tp_rank * v_local, (tp_rank + 1) * v_local, device=weight.device)
    bias = torch.where(rows < vocab_size, 0.0, PADDED_LOGIT).to(weight.dtype).unsqueeze(1)
    ones = torch.ones(hidden.shape[0], 1, dtype=hidden.dtype, device=hidden.device)
    return torch.cat([hidden, ones], dim=1), torch.cat([weight, bias], dim=1)


def _logprob_processor(vocab_size: int, temperature: float):
    """A GPTModel ``output_processor``: final hidden states [S, B, H] -> log-probs [B, S-1] (fp32)."""
    from megatron.core import parallel_state as ps

    def process(*, hidden_states, output_layer, output_weight, input_ids, **_):
        weight = output_weight if output_weight is not None else output_layer.weight
        s, b, h = hidden_states.shape
        hidden = hidden_states[:-1].transpose(0, 1).reshape(b * (s - 1), h)
        targets = input_ids[:, 1:].reshape(-1)
        tp_group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
        if weight.shape[0] * ps.get_tensor_model_parallel_world_size() > vocab_size:
            hidden, weight = _mask_padded_vocab(hidden, weight, vocab_size, ps.get_tensor_model_parallel_rank())
        logprobs, _ = logprob_entropy(hidden, weight, targets, tp_group=tp_group, temperature=temperature,
                                      compute_entropy=False)
        return logprobs.view(b, s - 1)

    return process


@torch.no_grad()
def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, *, vocab_size: int, temperature: float = 1.0,
                   micro_batch_size: int | None = None) -> torch.Tensor:
    """``out[b, t] = log p(input_ids[b, t+1] | input_ids[b, :t+1])`` under ``model`` at ``temperature``.

    Collective over the model-parallel group; every rank passes the same ``input_ids`` [B, S] (right
    padding is harmless: attention is causal) and gets the same [B, S-1] fp32 result. ``vocab_size`` is
    the real (HF) vocabulary size.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"token_logprobs: input_ids must be [batch, seq >= 2], got {tuple(input_ids.shape)}")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size:
        raise ValueError(f"token_logprobs: token ids must lie in [0, {vocab_size}); got range "
                         f"[{int(input_ids.min())}, {int(input_ids.max())}]")
    batch, seq = input_ids.shape
    mbs = micro_batch_size or batch
    if batch % mbs:
        raise ValueError(f"token_logprobs: micro_batch_size={mbs} does not divide the batch size {batch}")
    was_training = model.training
    model.eval()
    processor = _logprob_processor(vocab_size, temperature)
    positions = torch.arange(seq).unsqueeze(0).expand(mbs, -1)

    def step(data_iterator, chunk):
        ids = next(data_iterator)
        out = chunk(input_ids=ids, position_ids=positions, attention_mask=None, output_processor=processor)
        return out, lambda output_tensor, non_loss_data=False: output_tensor

    chunks = list(input_ids.long().split(mbs))
    outputs = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter(chunks), model=[model], num_microbatches=len(chunks),
        seq_length=seq, micro_batch_size=mbs, forward_only=True, collect_non_loss_data=True)
    model.train(was_training)
    if ps.is_pipeline_last_stage():
        result = torch.cat(list(outputs), dim=0).float()
    else:
        result = torch.empty(batch, seq - 1, dtype=torch.float32)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_pipeline_model_parallel_group()
        dist.broadcast(result, src=dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1),
                       group=group)
    return result


def ragged_token_logprobs(model: torch.nn.Module, sequences: list[list[int]], *, vocab_size: int,
                          temperature: float = 1.0, pad_id: int = 0) -> list[list[float]]:
    """:func:`token_logprobs` for sequences of different lengths (right-padded into one batch)."""
    if not sequences or min(len(s) for s in sequences) < 2:
        raise ValueError("ragged_token_logprobs: every sequence needs at least 2 tokens")
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    out = token_logprobs(model, ids, vocab_size=vocab_size, temperature=temperature)
    return [out[i, :len(s) - 1].tolist() for i, s in enumerate(sequences)]
