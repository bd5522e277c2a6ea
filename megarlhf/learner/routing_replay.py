"""Routing replay for mixture-of-experts actors (``algorithm.routing_replay``): the trainer's routers send
chosen tokens to given experts instead of their own top-k.

Why: an MoE policy's log-prob of a token depends on which experts it went through, and the top-k choice
flips between the rollout engine and the trainer (different kernels round differently at near-tied router
logits) and between the old and the updated policy. A flipped choice changes the log-prob far more than the
numerics do, so importance ratios and the step-0 gap grow with it.

* ``r3`` (rollout routing replay): the rollout engine records, per token and MoE layer, the experts it chose
  (:mod:`megarlhf.rollout.engines.routing`); the actor replays that routing when it computes the old log-probs and
  in every update forward.
* ``r2``: the actor records its own routing in the old-log-prob pass and replays it in the update's
  forwards (the routing of the policy that produced the old log-probs).
* ``none``: every forward routes by itself.

Replay keeps the router differentiable: the chosen experts are fixed, their weights are the model's own
scores at those experts (Megatron's ``RouterReplay`` contract), so gradients reach the router weights.
Tokens without a record (``UNROUTED``: the engine never ran them, e.g. a sample's last token) route
themselves. The reference model and the critic are never replayed.

Mechanics: :class:`RoutingReplay` puts one :class:`_ReplaySlot` in each router of this pipeline stage
(Megatron's ``router_replay`` hook, which its top-k routing calls). The forward schedule
(:func:`megarlhf.learner.forward.run_schedule`) calls :meth:`RoutingReplay.begin` with each micro-batch's
routing (:attr:`megarlhf.learner.packing.MicroBatch.routing`, in the model's token order) when its forward
starts, and again when its backward starts (a recomputing backward routes again). The batch-level record
is ``ExperienceBatch.routed_experts`` [B, L, moe_layers, top_k], token-aligned.

Metrics (counts on the device, summed over data x context parallel ranks and pipeline stages, one read):
over the (token, MoE layer) routing decisions that had a record, ``mismatch`` is the fraction where the
model's own top-k differs from the record (what routing would have been without replay), ``mismatch_replayed``
the fraction where the experts the model actually sent the token to (the router's routing map, read by a
forward hook, i.e. what Megatron's dispatcher uses) differ from it: 0 when replay works.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

ROUTING_REPLAY_MODES = ("none", "r2", "r3")
UNROUTED = -1  # a record's entry for a token nobody routed: the model routes it itself
ROUTING_DTYPE = torch.int16


def unrouted(tokens: int, layers: int, top_k: int) -> Tensor:
    """A routing record of ``tokens`` tokens none of which was routed."""
    return torch.full((tokens, layers, top_k), UNROUTED, dtype=ROUTING_DTYPE)  # host: records live there


def moe_layer_indices(provider) -> tuple[int, ...]:
    """The HF layer indices of a provider's MoE layers, in order: the routing record's layer axis."""
    return tuple(i for i, is_moe in enumerate(provider.moe_layer_pattern()) if is_moe)


class _ReplaySlot:
    """One router's hook: Megatron's top-k routing calls :meth:`get_replay_topk` instead of its top-k."""

    def __init__(self, owner: "RoutingReplay", ordinal: int):
        self.owner, self.ordinal = owner, ordinal
        self.layer_number = None  # Megatron sets it on the router's replay object

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[Tensor, Tensor]:
        own_scores, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        owner = self.owner
        if owner.recording_now:
            owner.recording[-1].append(own.detach())
        if owner.target is None:
            return own_scores, own
        wanted = owner.target[:, self.ordinal].to(device=scores.device, dtype=torch.long)  # [tokens, top_k]
        if wanted.shape[0] != scores.shape[0]:
            raise RuntimeError(f"routing replay: the micro-batch's record has {wanted.shape[0]} tokens, the router "
                               f"routes {scores.shape[0]}")
        recorded = wanted[:, 0] != UNROUTED
        if owner.counting:
            with torch.no_grad():
                own_differs = (own.sort(-1).values != wanted.sort(-1).values).any(-1) & recorded
                owner.counts[0] += own_differs.sum()
                owner.counts[2] += recorded.sum()
        used = torch.where(recorded[:, None], wanted, own)
        return scores.gather(1, used), used

    def check_routing_map(self, module, args, output) -> None:
        """A forward hook on the router: counts the recorded tokens whose routing map (the experts Megatron's
        dispatcher sends them to) is not exactly the record's experts."""
        owner = self.owner
        if not owner.counting:
            return
        with torch.no_grad():
            routing_map = output[1]  # [tokens, experts] bool
            wanted = owner.target[:, self.ordinal].to(device=routing_map.device, dtype=torch.long)
            recorded = wanted[:, 0] != UNROUTED
            expected = torch.zeros_like(routing_map).scatter(1, wanted.clamp(min=0), True)
            owner.counts[1] += ((routing_map != expected).any(-1) & recorded).sum()


class RoutingReplay:
    """Replays given routing in (and records the routing of) one model's routers on this pipeline stage."""

    def __init__(self, model: torch.nn.Module, moe_layers: Sequence[int], device: torch.device, sequence_split=None):
        from megarlhf.learner.moe_metrics import stage_routers

        # sequence parallelism: the routers of this TP rank see its 1 / TP of each micro-batch's tokens (a
        # contiguous part of the routers' token order); ``sequence_split`` is the TP group then, else None
        self.sequence_split = sequence_split
        ordinal = {layer: i for i, layer in enumerate(moe_layers)}
        self.num_layers = len(moe_layers)
        self.stage_ordinals = []  # the record's layer axis entries this stage routes
        for layer, router in stage_routers(model):
            slot = _ReplaySlot(self, ordinal[layer])
            router.router_replay = slot
            router.register_forward_hook(slot.check_routing_map)
            self.stage_ordinals.append(ordinal[layer])
        self.target: Tensor | None = None
        self.counting = False
        self.recording: list[list[Tensor]] | None = None  # per recorded micro-batch, its routers' own choices
        self.recording_now = False  # the running micro-batch is recorded (not an expert-parallel padding one)
        self.counts = torch.zeros(3, dtype=torch.float64, device=device)

    @classmethod
    def attach(cls, model: torch.nn.Module, provider, mode: str, runtime) -> "RoutingReplay | None":
        """The replay of a trained actor (None when ``mode`` is "none")."""
        from model_providers.hf_checkpoint import unwrap

        if mode not in ROUTING_REPLAY_MODES:
            raise ValueError(f"routing replay: unknown mode {mode!r} ({', '.join(ROUTING_REPLAY_MODES)})")
        if mode == "none":
            return None
        split = runtime.tp if getattr(unwrap(model).config, "sequence_parallel", False) else None
        return cls(model, moe_layer_indices(provider), runtime.device, split)

    # ---- the schedule's side ------------------------------------------------------------------------
    def begin(self, target: Tensor | None, *, count: bool, record: bool) -> None:
        """A micro-batch's forward (or recomputing backward) starts: replay ``target`` ([tokens, moe_layers,
        top_k] in the model's token order; None: route freely), count mismatches, record the own routing."""
        if target is not None and self.sequence_split is not None:
            target = target.chunk(self.sequence_split.size)[self.sequence_split.rank]
        self.target, self.counting, self.recording_now = target, count and target is not None, record
        if record:
            if self.recording is None:
                self.recording = []
            self.recording.append([])

    def end(self) -> None:
        """The schedule is over: nothing is replayed or recorded until the next :meth:`begin`."""
        self.target, self.counting, self.recording_now = None, False, False

    def reset_counts(self) -> None:
        """Starts the mismatch counts afresh (before a pass whose metrics are read; not collective)."""
        self.counts.zero_()

    # ---- records ------------------------------------------------------------------------------------
    def take_recorded(self, micro_batches: list, batch_shape: tuple[int, int], top_k: int) -> Tensor:
        """The routing this stage's routers chose in a recorded pass over ``micro_batches``, as a token-aligned
        record [B, L, moe_layers, top_k] (other stages' layers ``UNROUTED``)."""
        recorded, self.recording = self.recording or [], None
        if len(recorded) != len(micro_batches):
            raise RuntimeError(f"routing replay: {len(recorded)} recorded micro-batches for {len(micro_batches)}")
        device = self.counts.device
        out = torch.full((*batch_shape, self.num_layers, top_k), UNROUTED, dtype=ROUTING_DTYPE, device=device)
        for mb, layers in zip(micro_batches, recorded):
            if not layers:
                continue
            local = torch.stack(layers, dim=1).to(ROUTING_DTYPE)  # [tokens, stage layers, top_k]
            if self.sequence_split is not None:  # this TP rank routed its part of the tokens
                local = _all_gather_tokens(local, self.sequence_split.group)
            rows = mb.token_rows(local)  # [n, width, stage layers, top_k]
            for j, ordinal in enumerate(self.stage_ordinals):
                out[mb.rows, :mb.width, ordinal] = rows[:, :, j]
        return out

    def mismatch_metrics(self, runtime, prefix: str) -> dict[str, float]:
        """``{prefix}mismatch``, ``{prefix}mismatch_replayed`` since the last call (module docstring), identical
        on every rank; {} when no routing decision had a record."""
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        runtime.all_reduce_on_device(counts, over="dp_cp")
        if self.sequence_split is not None:  # the TP ranks routed different tokens
            runtime.all_reduce_on_device(counts, over="tp")
        if runtime.pp.size > 1:  # stages hold disjoint layers
            runtime.all_reduce_on_device(counts, over="pp")
        own, used, decisions = counts.tolist()  # host: the one read
        if decisions == 0:
            return {}
        return {f"{prefix}mismatch": own / decisions, f"{prefix}mismatch_replayed": used / decisions}


def _all_gather_tokens(local: Tensor, group) -> Tensor:
    """Every TP rank's equal part of the tokens, concatenated in rank order (gloo gathers no int16)."""
    parts = [torch.empty_like(local, dtype=torch.int32) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, local.int(), group=group)
    return torch.cat(parts).to(local.dtype)
