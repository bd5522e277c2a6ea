"""The one forward of the trainer: per-token log-probs (+ entropy) or values over micro-batches.

Every micro-batch goes through Megatron's ``get_forward_backward_func`` (so tensor, pipeline and context
parallelism work unchanged). On the last pipeline stage GPTModel's ``output_processor`` hook receives
the final hidden states and computes, only at the positions the micro-batch wants:

* ``logprobs`` models: log-probs of the next token (and its entropy) with the fused vocab-parallel op
  (:func:`megarlhf.ops.logprob_entropy`); the [tokens x vocab] logits are never built. Megatron's padded
  vocabulary rows are removed from the softmax (:func:`mask_padded_vocab`), so these log-probs are
  HF's and vLLM's. Distillation adds two variants: a teacher's pass also returns the top-k of each
  position's distribution (``top_k``: ``topk_logprobs`` and ``topk_ids``, [n, L, K], and ``topk_rest`` [n, L],
  the log-probability outside them, by :func:`megarlhf.ops.topk_logprobs`), and a student's training pass also
  returns its log-probs at the ids each micro-batch carries (``at_ids``: :attr:`MicroBatch.target_ids`, the
  teacher's top-k; ``target_logprobs`` [n, L, K] and ``target_rest`` [n, L]), in the same vocabulary walk as the
  sampled token's.
* ``values`` models (value head, :mod:`model_providers.value_head`): the head's scalar per position.
* ``scores`` (a value-head model used as a reward model): the head's scalar at each sequence's last
  token, one per sequence (:meth:`MicroBatch.last_token_outputs`).

The per-position outputs are put back in the experience's token-aligned [n, L] layout by
:meth:`MicroBatch.to_rows` (autograd-aware, so a loss computed there trains the model), then either
handed to a loss function (training; :mod:`megarlhf.learner.step`) or collected (forward-only;
:func:`forward_only` returns [B, L] tensors on every rank). Training, scoring and the weight-sync
probe all read log-probs through this module: there is one trainer-side log-prob path.

Expert parallelism: an MoE layer exchanges tokens with its expert-parallel peers in every forward and
backward, so those ranks must run the same number of micro-batches, while packing gives each data-parallel
rank as many as its own sequences need. :func:`expert_parallel_padding` agrees on the largest count; a rank
with fewer runs the difference as padding micro-batches (a copy of its first one, every token marked as
padding for the routers, so the router losses and the routing metrics leave them out; their loss share is
0 times their outputs, so backward runs and every gradient they add is zero). Their outputs are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor

from megarlhf.ops import LogprobOptions, logprob_entropy, topk_logprobs
from megarlhf.learner.packing import MicroBatch
from parallel.runtime import Runtime

OUTPUT_KINDS = ("logprobs", "values", "scores")
PADDED_LOGIT = -1.0e30


@dataclass(frozen=True)
class Outputs:
    """What a pass computes at each wanted position: ``kind`` (one of :data:`OUTPUT_KINDS`); for log-probs,
    over the model's first ``vocab_size`` vocabulary rows at ``temperature``, with their ``entropy``."""

    kind: str
    vocab_size: int
    temperature: float = 1.0
    entropy: bool = False
    top_k: int = 0  # a frozen teacher's pass: also the top-k of each position's distribution (forward only)
    at_ids: bool = False  # also the log-probs at each micro-batch's target_ids (a distillation loss's)
    backend: str = "auto"  # the log-prob op's (megarlhf.ops.logprob_entropy): "torch" where passes must agree with
    # an at_ids pass, which only the torch op runs

    def fields(self, batch_shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each output of a forward-only pass over a [B, L] batch."""
        if self.kind == "scores":
            return {"scores": (batch_shape[:1], torch.float32)}  # one score per sequence
        if self.kind == "values":
            return {"values": (batch_shape, torch.float32)}
        out = {"logprobs": (batch_shape, torch.float32)}
        if self.entropy:
            out["entropy"] = (batch_shape, torch.float32)
        if self.top_k:
            out.update(topk_logprobs=((*batch_shape, self.top_k), torch.float32),
                       topk_ids=((*batch_shape, self.top_k), torch.long), topk_rest=(batch_shape, torch.float32))
        return out


def mask_padded_vocab(hidden: Tensor, weight: Tensor, vocab_size: int, tp_rank: int) -> tuple[Tensor, Tensor]:
    """Removes Megatron's padded vocabulary rows (beyond the HF ``vocab_size``) from the softmax exactly.

    Appends a hidden column of ones and a weight column that is 0 for real rows and -1e30 for padded
    ones, so a padded row's logit is -1e30 and its ``exp`` is 0, while real logits are unchanged.
    """
    v_local = weight.shape[0]
    rows = torch.arange(tp_rank * v_local, (tp_rank + 1) * v_local, device=weight.device)
    bias = torch.where(rows < vocab_size, 0.0, PADDED_LOGIT).to(weight.dtype).unsqueeze(1)
    ones = torch.ones(hidden.shape[0], 1, dtype=hidden.dtype, device=hidden.device)
    return torch.cat([hidden, ones], dim=1), torch.cat([weight, bias], dim=1)


def _whole_sequence(hidden_states: Tensor, config, tp) -> Tensor:
    """The final hidden states of every position: under sequence parallelism each TP rank holds 1 / TP of
    them, so they are gathered. Backward keeps this rank's part of the gradient: every rank's gradient is
    already the whole one (the vocab-parallel log-prob's backward sums over TP ranks; a value head is
    replicated)."""
    if not getattr(config, "sequence_parallel", False):
        return hidden_states
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False, group=tp.group)


def _processor(outputs: Outputs, mb: MicroBatch, runtime: Runtime):
    """A GPTModel ``output_processor``: hidden [S, b, H] -> {name: [b, S] fp32} at the wanted positions."""
    mask = mb.label_mask.reshape(-1)
    tp, vocab_size, entropy = runtime.tp, outputs.vocab_size, outputs.entropy

    def logprobs(*, hidden_states, output_layer, output_weight, config=None, **_):
        hidden_states = _whole_sequence(hidden_states, config, tp)
        weight = output_weight if output_weight is not None else output_layer.weight
        s, b, h = hidden_states.shape
        hidden = hidden_states.transpose(0, 1).reshape(b * s, h)
        if weight.shape[0] * tp.size > vocab_size:
            hidden, weight = mask_padded_vocab(hidden, weight, vocab_size, tp.rank)
        # check_targets=False: run_schedule checked every micro-batch at once
        options = LogprobOptions(tp_group=tp.group, temperature=outputs.temperature, compute_entropy=entropy,
                                 check_targets=False, selected=mb.wanted_tokens, backend=outputs.backend)
        targets = mb.labels.reshape(-1)
        if outputs.top_k:
            lp, top_lp, top_ids, rest = topk_logprobs(hidden, weight, targets, mask, outputs.top_k, options)
            return {"logprobs": lp.view(b, s), "topk_logprobs": top_lp.view(b, s, -1),
                    "topk_ids": top_ids.view(b, s, -1), "topk_rest": rest.view(b, s)}
        if outputs.at_ids:  # the sampled token's log-prob, those at the K ids and the rest's, in one vocabulary walk
            targets = torch.cat([targets[:, None], mb.target_ids.reshape(b * s, -1)], dim=1)
            options = replace(options, rest_from=1)
        lp, ent = logprob_entropy(hidden, weight, targets, mask, options)
        if outputs.at_ids:
            out = {"logprobs": lp[:, 0].reshape(b, s), "target_logprobs": lp[:, 1:-1].reshape(b, s, -1),
                   "target_rest": lp[:, -1].reshape(b, s)}
        else:
            out = {"logprobs": lp.view(b, s)}
        if entropy:
            out["entropy"] = ent.view(b, s)
        return out

    def values(*, hidden_states, output_layer, config=None, **_):
        hidden_states = _whole_sequence(hidden_states, config, tp)
        v = output_layer(hidden_states)[0].squeeze(-1).transpose(0, 1).float()  # [b, S]
        return {"values": torch.where(mb.label_mask, v, v.new_zeros(()))}

    def scores(*, hidden_states, output_layer, config=None, **_):
        hidden_states = _whole_sequence(hidden_states, config, tp)
        return {"scores": output_layer(hidden_states)[0].squeeze(-1).transpose(0, 1).float()}  # [b, S]

    return {"logprobs": logprobs, "values": values, "scores": scores}[outputs.kind]


def check_token_ids(micro_batches: list[MicroBatch], vocab_size: int) -> None:
    """Raises unless every token whose log-prob is wanted lies in the model's vocabulary ``[0, vocab_size)``
    (a tokenizer with more tokens than the model, or an engine that sampled a padded-vocab row), and sets
    each micro-batch's ``wanted_tokens`` (the log-prob op then picks its rows without a read of its own).
    One device read for all the micro-batches of a pass, instead of two per micro-batch in the op."""
    stats = torch.stack([torch.stack([(((mb.labels < 0) | (mb.labels >= vocab_size)) & mb.label_mask).sum(),
                                      mb.label_mask.sum()]) for mb in micro_batches])
    host = stats.tolist()  # host: the one read
    for mb, (_, wanted) in zip(micro_batches, host):
        mb.wanted_tokens = wanted
    if not any(bad for bad, _ in host):
        return
    labels = torch.cat([mb.labels[mb.label_mask] for mb in micro_batches])
    outside = labels[(labels < 0) | (labels >= vocab_size)]
    raise ValueError(f"token ids {sorted(set(outside.tolist()))[:8]} lie outside the model's vocabulary "
                     f"[0, {vocab_size}): the tokenizer or the rollout engine produced tokens the model has "
                     f"no embedding for")


LossFn = Callable[[MicroBatch, dict], tuple[Tensor, dict]]


def _needs_equal_schedules(config, runtime: Runtime) -> bool:
    """Whether the model's MoE layers run collectives over data-parallel peers in every micro-batch."""
    global_balance = (getattr(config, "moe_router_load_balancing_type", None) == "global_aux_loss"
                      and bool(getattr(config, "moe_aux_loss_coeff", 0)))
    return runtime.ep.size > 1 or (global_balance and runtime.dp_cp.size > 1)


def expert_parallel_padding(micro_batches: list[MicroBatch], runtime: Runtime, config=None) -> list[MicroBatch]:
    """The padding micro-batches this rank runs so that its expert-parallel peers, which exchange tokens in
    every micro-batch, run as many as it does (module docstring); none where the model (``config``, its
    TransformerConfig) needs no equal schedules. One all-reduce of the counts over the data x context
    parallel ranks (host read: the count sizes the schedule)."""
    if not _needs_equal_schedules(config, runtime):
        return []
    most = runtime.all_reduce([len(micro_batches)], op="max", over="dp_cp")[0]
    return [micro_batches[0]] * (int(most) - len(micro_batches))


class _RouterState:
    """What an MoE model's routers must know about the micro-batch they route: a padding one runs without
    router losses, a real one with them and with its routing to replay (``replay``:
    :class:`megarlhf.learner.routing_replay.RoutingReplay`; its own routing recorded when ``record``).

    Set when a micro-batch's forward starts and again when its backward starts (:meth:`at_backward`): a
    recomputing backward runs the routers again, and the pipeline schedule interleaves one micro-batch's
    backward with another's forward. A dense model has nothing to set."""

    def __init__(self, config, scheduled: list[MicroBatch], real: int, replay=None, record: bool = False):
        self.config, self.scheduled, self.real, self.replay, self.record = config, scheduled, real, replay, record
        self.coefficients = (getattr(config, "moe_aux_loss_coeff", 0.0), getattr(config, "moe_z_loss_coeff", None))
        self.losses = self.coefficients != (0.0, None)

    def _losses(self, on: bool) -> None:
        if self.losses:
            self.config.moe_aux_loss_coeff, self.config.moe_z_loss_coeff = self.coefficients if on else (0.0, None)

    def enter(self, index: int, forward: bool = True) -> None:
        """Micro-batch ``index`` (of the schedule; padding from ``real`` on) starts its forward or backward."""
        real = index < self.real
        self._losses(real)
        if self.replay is not None:
            self.replay.begin(self.scheduled[index].routing if real else None, count=forward and real,
                              record=forward and real and self.record)

    def at_backward(self, tensor: Tensor, index: int) -> Tensor:
        """``tensor`` (the micro-batch's loss share, or a pipeline stage's output), whose gradient's arrival
        (the first thing of the micro-batch's backward on this stage) enters micro-batch ``index`` again."""
        if (self.losses or self.replay is not None) and tensor.requires_grad:
            tensor.register_hook(lambda grad: self.enter(index, forward=False))
        return tensor

    def finish(self) -> None:
        self._losses(True)
        if self.replay is not None:
            self.replay.end()


def run_schedule(model: torch.nn.Module, micro_batches: list[MicroBatch], runtime: Runtime, outputs: Outputs, *,
                 loss_fn: LossFn | None = None, replay=None, record_routing: bool = False) -> list:
    """Runs ``micro_batches`` through Megatron's schedule; forward-only when ``loss_fn`` is None.

    Forward-only: returns, on the last pipeline stage, one ``{name: [n, width]}`` dict per micro-batch
    (nothing elsewhere). Training: ``loss_fn(mb, outputs) -> (share, metrics)`` per micro-batch, where
    ``share`` is the micro-batch's exact share of the loss to backpropagate; Megatron's 3-tuple loss
    form with ``calculate_per_token_loss=False`` divides it by ``num_tokens`` (passed as 1) and by the
    number of micro-batches, which is undone here, so the gradient is exactly that of the sum of the
    shares (before DDP's average over data-parallel x context-parallel ranks). Returns the metrics dicts (last stage).

    ``replay`` (an MoE actor's :class:`~megarlhf.learner.routing_replay.RoutingReplay`) replays each
    micro-batch's ``routing`` and, with ``record_routing``, records the model's own.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if outputs.kind not in OUTPUT_KINDS:
        raise ValueError(f"run_schedule: kind must be one of {OUTPUT_KINDS}, got {outputs.kind!r}")
    if not micro_batches:
        raise ValueError("run_schedule: no micro-batches")
    if outputs.kind == "logprobs":
        check_token_ids(micro_batches, outputs.vocab_size)
    real = len(micro_batches)
    config = getattr(model, "config", None)
    scheduled = [*micro_batches, *expert_parallel_padding(micro_batches, runtime, config)]
    count = len(scheduled)
    routers = _RouterState(config, scheduled, real, replay, record_routing)
    moe = bool(getattr(config, "num_moe_experts", None))
    sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def step(data_iterator, chunk):
        index, mb = next(data_iterator)
        padding = index >= real  # an expert-parallel padding micro-batch: every token is padding for the routers
        masked = {}
        if padding:
            masked = {"padding_mask": torch.ones_like(mb.tokens, dtype=torch.bool)}
        elif moe and mb.padding is not None:  # the sequence-parallel padding segment
            masked = {"padding_mask": mb.padding}
        if masked and sequence_parallel and not runtime.is_first_stage:
            # GPTModel splits the mask over the TP ranks with the embeddings, i.e. on the first stage only
            masked = {"padding_mask": masked["padding_mask"].chunk(runtime.tp.size, dim=1)[runtime.tp.rank]}
        routers.enter(index)
        output = chunk(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params,
                       output_processor=_processor(outputs, mb, runtime), **masked)
        if isinstance(output, Tensor):  # not the last pipeline stage: its backward starts at this output
            output = routers.at_backward(output, index)

        def finish(output_tensor, non_loss_data=False):
            rows = {name: mb.last_token_outputs(value) if name == "scores" else mb.to_rows(value)
                    for name, value in output_tensor.items()}
            if loss_fn is None:
                return {name: value.detach() for name, value in rows.items()}
            if padding:  # zero share, but a backward through the model like its peers'
                share = routers.at_backward(sum(value.sum() for value in rows.values()) * 0.0, index)
                return share * count, torch.ones((), dtype=torch.int, device=share.device), {}
            share, metrics = loss_fn(mb, rows)
            share = routers.at_backward(share, index)
            return share * count, torch.ones((), dtype=torch.int, device=share.device), metrics

        return output, finish

    longest = max(int(mb.tokens.shape[-1]) for mb in scheduled)
    try:
        outputs = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(enumerate(scheduled)), model=[model], num_microbatches=count,
            seq_length=longest, micro_batch_size=max(int(mb.tokens.shape[0]) for mb in scheduled),
            forward_only=loss_fn is None, collect_non_loss_data=loss_fn is None)
    finally:  # a failed schedule leaves no router losses off and no routing replayed
        routers.finish()
    return outputs[:real]


@torch.no_grad()
def forward_only(model: torch.nn.Module, micro_batches: list[MicroBatch], batch_shape: tuple[int, int],
                 runtime: Runtime, outputs: Outputs, *, replay=None, record_routing: bool = False
                 ) -> dict[str, Tensor]:
    """Per-token outputs of a whole batch, [B, L] fp32 each, token-aligned ([B] for ``scores``, [B, L, K] for a
    teacher's top-k: :meth:`Outputs.fields`), identical on every rank of the pipeline, on the runtime's device.
    The model is put in eval mode for the pass and restored after.
    """
    was_training = model.training
    model.eval()
    try:
        results = run_schedule(model, micro_batches, runtime, outputs, replay=replay, record_routing=record_routing)
    finally:
        model.train(was_training)
    fields = outputs.fields(batch_shape)
    out = {name: torch.zeros(shape, dtype=dtype, device=runtime.device) for name, (shape, dtype) in fields.items()}
    if runtime.is_last_stage:
        for mb, rows in zip(micro_batches, results):
            for name, (_, dtype) in fields.items():
                if name == "scores":
                    out[name][mb.rows] = rows[name].float()
                else:
                    out[name][mb.rows, :mb.width] = rows[name].to(dtype)
    return {name: runtime.broadcast_from_last_stage(value) for name, value in out.items()}
