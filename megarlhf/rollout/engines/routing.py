"""What a rollout engine's MoE routers chose: one record per sample, for routing replay (R3).

A sample's routing record (the format is :mod:`megarlhf.learner.routing_replay`'s, the trainer's side) is an
int16 tensor ``[tokens, moe_layers, top_k]`` on the host: row ``t`` holds the
experts each MoE layer (in layer order) sent token ``t`` of prompt + response to when the engine computed that
token (a prompt token in the prefill, a generated one in the decode step that fed it). ``UNROUTED`` (-1)
marks tokens the engine never ran through the model: a sample's last token (sampled, never fed back) and,
in a vLLM record, anything past what vLLM returned. The trainer routes those tokens itself
(:mod:`megarlhf.learner.routing_replay`); their outputs predict nothing a loss reads.

* :class:`GateRecorder`: the HF engine's recorder, forward hooks on transformers' top-k routers (their
  third output is the chosen experts);
* :func:`record_from_vllm`: a vLLM ``CompletionOutput.routed_experts`` (``[tokens, all layers, top_k]``,
  dense layers included) as a record;
* :func:`engine_routing`: what a run's engines record;
* :func:`share_prompt_routing`: one routing per prompt for all its samples;
* :func:`merge_turns`: a multi-turn episode's record after one more turn: every token keeps the routing
  of the call that first computed it (the one its log-prob came from).
"""
from __future__ import annotations

import torch
from torch import Tensor

from megarlhf.learner.routing_replay import ROUTING_DTYPE, UNROUTED, moe_layer_indices, unrouted


def engine_routing(config) -> dict:
    """The routing arguments of ``EngineConfig.from_rollout`` for a run: the MoE layers whose routing the
    engine records under ``algorithm.routing_replay='r3'``; {} otherwise."""
    if config.algorithm.routing_replay != "r3":
        return {}
    from model_providers import get_provider

    provider = get_provider(config.model.path)
    if not provider.is_moe:
        raise ValueError(f"algorithm.routing_replay='r3' replays the routing of a mixture-of-experts model; "
                         f"{config.model.path} ({provider.model_type}) is dense: set it to 'none'")
    return {"routing_layers": moe_layer_indices(provider)}


def record_from_vllm(routed, moe_layers: tuple[int, ...], tokens: int, top_k: int, num_experts: int) -> Tensor:
    """vLLM's ``routed_experts`` of one sample (numpy ``[n, num_hidden_layers, top_k]``) as a record of
    ``tokens`` rows over the MoE layers ``moe_layers`` (HF layer indices). An engine's output is checked like
    any input: every entry an expert of the model, ``top_k`` different experts per token and layer."""
    record = unrouted(tokens, len(moe_layers), top_k)
    if routed is None:
        return record
    values = torch.as_tensor(routed).long()  # host: vLLM hands the record over as a numpy array
    if values.dim() != 3 or values.shape[2] != top_k or values.shape[1] <= max(moe_layers):
        raise ValueError(f"rollout engine: vLLM returned routed experts of shape {tuple(values.shape)}; expected "
                         f"[tokens, layers > {max(moe_layers)}, {top_k}]")
    rows = min(tokens, values.shape[0])
    chosen = values[:rows, list(moe_layers)]
    ordered = chosen.sort(-1).values
    if bool(((chosen < 0) | (chosen >= num_experts)).any() | (ordered[..., 1:] == ordered[..., :-1]).any()):
        raise ValueError(f"rollout engine: vLLM's routed experts name experts outside [0, {num_experts}) or one "
                         f"expert twice for a token")
    record[:rows] = chosen.to(ROUTING_DTYPE)
    return record


def merge_turns(known: Tensor | None, latest: Tensor) -> Tensor:
    """An episode's record after a turn whose call's record is ``latest`` (its prompt, i.e. the episode so
    far, then the turn): tokens ``known`` already routed keep that routing, the rest take ``latest``'s."""
    if known is None:
        return latest
    if latest.shape[0] < known.shape[0] or latest.shape[1:] != known.shape[1:]:
        raise ValueError(f"multi-turn routing: a turn's record {tuple(latest.shape)} does not extend the episode's "
                         f"{tuple(known.shape)}")
    head = torch.where(known != UNROUTED, known, latest[:known.shape[0]])
    return torch.cat([head, latest[known.shape[0]:]])


def share_prompt_routing(prompt_index: list[int], prompt_ids: list[list[int]], records: list[Tensor]) -> list[Tensor]:
    """The records with every prompt's tokens routed as in its first sample's record.

    Samples of one prompt share its prefill: the HF engine runs it once, vLLM computes a shared prompt once
    with prefix caching, but two separately scheduled prefills of one prompt may round differently. Training
    packs a prompt's samples as one shared prefix replayed once (:mod:`megarlhf.learner.packing`), from
    whichever sample comes first in that micro-batch; one routing per prompt makes the old-log-prob pass and
    every update replay the same one."""
    first: dict[int, Tensor] = {}
    shared = []
    for p, ids, record in zip(prompt_index, prompt_ids, records):
        if p in first:
            shared.append(torch.cat([first[p], record[len(ids):]]))
        else:
            first[p] = record[:len(ids)]
            shared.append(record)
    return shared


class GateRecorder:
    """Records, forward by forward, the experts every MoE router of a transformers model picks.

    transformers' MoE blocks (Qwen2-MoE, Qwen3-MoE, Mixtral) route through a ``...TopKRouter`` module that
    returns ``(logits, weights, experts)``; a hook keeps ``experts`` ([batch x seq, top_k], batch-major).
    """

    def __init__(self, model: torch.nn.Module, moe_layers: tuple[int, ...]):
        gates = [m for _, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]
        if len(gates) != len(moe_layers):
            raise ValueError(f"HF rollout engine: the model has {len(gates)} MoE routers, the trainer expects "
                             f"{len(moe_layers)} (layers {list(moe_layers)}): routing cannot be recorded")
        self.top_k = int(gates[0].top_k)
        self.active = False  # on only inside a decode loop: the probe's forwards are not recorded
        self._taken: list[Tensor] = []
        for gate in gates:
            gate.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        if self.active:
            self._taken.append(output[2])

    def take(self, batch: int, seq: int) -> Tensor:
        """The routing of the forward just run, ``[batch, seq, moe_layers, top_k]`` (on the model's device)."""
        taken, self._taken = self._taken, []
        if not taken:
            raise RuntimeError("HF rollout engine: no routing was recorded in the last forward")
        return torch.stack(taken, dim=1).view(batch, seq, len(taken), self.top_k).to(ROUTING_DTYPE)
