"""The experience batch: the sequences of one RL step on this data-parallel rank, and per-token fields.

Layout (the one every trainer function reads and writes): ``input_ids`` [B, L] holds prompt + response
tokens, right-padded; ``lengths`` [B] the real lengths. Every per-token field is [B, L] and
*token-aligned*: ``field[b, t]`` belongs to token ``input_ids[b, t]``, e.g. ``old_logprobs[b, t] =
log pi_old(input_ids[b, t] | input_ids[b, :t])`` and ``values[b, t]`` the critic's value of the state
before token t is generated (both computed from the hidden state at t - 1). Column 0 is never a response
token (a prompt has at least one token), and padding may hold anything: it is masked everywhere.

Devices: a batch lives on one device (the runtime's); :meth:`ExperienceBatch.from_sequences` builds it
there from token lists in one host-to-device copy per field, and every derived batch stays there.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from megarlhf.learner.routing_replay import UNROUTED

PER_TOKEN_FIELDS = ("rollout_logprobs", "old_logprobs", "ref_logprobs", "values", "advantages", "returns",
                    "teacher_logprobs", "teacher_topk_rest")
TOP_K_FIELDS = ("teacher_topk_logprobs", "teacher_topk_ids")  # [B, L, K]


@dataclass
class ExperienceBatch:
    """Sequences and their per-token fields (see the module docstring for the layout)."""

    input_ids: Tensor  # [B, L] int64, right-padded
    lengths: Tensor  # [B] int64, prompt + response tokens
    response_mask: Tensor  # [B, L] bool, True on response tokens
    rollout_logprobs: Tensor | None = None  # [B, L] from the rollout engine
    old_logprobs: Tensor | None = None  # [B, L] actor before this step's update
    ref_logprobs: Tensor | None = None  # [B, L] frozen reference
    values: Tensor | None = None  # [B, L] critic before this step's update
    advantages: Tensor | None = None  # [B, L]
    returns: Tensor | None = None  # [B, L] critic targets
    group_ids: Tensor | None = None  # [B] prompt ids (samples of one prompt share an id)
    teacher_logprobs: Tensor | None = None  # [B, L] a teacher's log-probs of the tokens (algorithm.distill)
    teacher_topk_logprobs: Tensor | None = None  # [B, L, K] the teacher's top-k log-probs at each token's position
    teacher_topk_ids: Tensor | None = None  # [B, L, K] int64: their vocabulary ids
    teacher_topk_rest: Tensor | None = None  # [B, L] the log-probability outside them
    # [B, L, moe_layers, top_k] int16, token-aligned: the routing an MoE actor replays (megarlhf.learner.routing_replay)
    routed_experts: Tensor | None = None
    # ``lengths`` on the host. Given by the constructors that know them (from_sequences and sft_batch, whose
    # masks are right by construction; select and replace, whose source batch was checked): sizes are then
    # read from here and the response mask is not checked again (a device read). Read once when not given.
    host_lengths: tuple[int, ...] | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        where = "ExperienceBatch"
        if not isinstance(self.input_ids, Tensor) or self.input_ids.dim() != 2:
            raise ValueError(f"{where}: input_ids must be a [B, L] tensor")
        batch, width = self.input_ids.shape
        self.input_ids = self.input_ids.long()
        self.lengths = torch.as_tensor(self.lengths, dtype=torch.long, device=self.input_ids.device)
        if tuple(self.lengths.shape) != (batch,):
            raise ValueError(f"{where}: lengths has shape {tuple(self.lengths.shape)}, expected ({batch},)")
        checked = self.host_lengths is not None
        if not checked:
            self.host_lengths = tuple(self.lengths.tolist())  # host: one read, then sizes come from here
        self.host_lengths = tuple(int(n) for n in self.host_lengths)
        if len(self.host_lengths) != batch:
            raise ValueError(f"{where}: {len(self.host_lengths)} host_lengths for {batch} sequences")
        if batch and (min(self.host_lengths) < 2 or max(self.host_lengths) > width):
            raise ValueError(f"{where}: lengths must lie in [2, {width}] (input_ids width); got "
                             f"[{min(self.host_lengths)}, {max(self.host_lengths)}]")
        if tuple(self.response_mask.shape) != (batch, width):
            raise ValueError(f"{where}: response_mask has shape {tuple(self.response_mask.shape)}, "
                             f"expected {(batch, width)}")
        self.response_mask = self.response_mask.bool()
        if not checked:
            self._check_response_mask()
        for name in PER_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (batch, width):
                raise ValueError(f"{where}: {name} has shape {tuple(value.shape)}, expected {(batch, width)}")
        top_k = [getattr(self, name) for name in TOP_K_FIELDS]
        if (top_k[0] is None) != (top_k[1] is None) or any(
                value is not None and (value.dim() != 3 or tuple(value.shape[:2]) != (batch, width)
                                       or value.shape != top_k[0].shape) for value in top_k):
            raise ValueError(f"{where}: teacher_topk_logprobs and teacher_topk_ids go together, both "
                             f"({batch}, {width}, K); got {[None if v is None else tuple(v.shape) for v in top_k]}")
        if self.routed_experts is not None and (self.routed_experts.dim() != 4
                                                or tuple(self.routed_experts.shape[:2]) != (batch, width)):
            raise ValueError(f"{where}: routed_experts has shape {tuple(self.routed_experts.shape)}, expected "
                             f"({batch}, {width}, moe_layers, top_k)")
        if self.group_ids is not None and tuple(self.group_ids.shape) != (batch,):
            raise ValueError(f"{where}: group_ids has shape {tuple(self.group_ids.shape)}, expected ({batch},)")
        device = self.input_ids.device
        elsewhere = [f.name for f in dataclasses.fields(self)
                     if isinstance(getattr(self, f.name), Tensor) and getattr(self, f.name).device != device]
        if elsewhere:
            raise ValueError(f"{where}: {', '.join(elsewhere)} not on the batch's device {device}")

    def _check_response_mask(self) -> None:
        """Raises if ``response_mask`` marks column 0 or padding (one device read)."""
        width = self.input_ids.shape[1]
        beyond = torch.arange(width, device=self.input_ids.device)[None, :] >= self.lengths[:, None]
        if bool(self.response_mask[:, 0].any() | (self.response_mask & beyond).any()):
            raise ValueError("ExperienceBatch: response_mask marks column 0 or a position past a sequence's length "
                             "(column 0 is always prompt; padding is never response)")

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @classmethod
    def from_sequences(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                       device: torch.device, pad_id: int = 0,
                       rollout_logprobs: Sequence[Sequence[float]] | None = None,
                       group_ids: Sequence[int] | None = None,
                       loss_masks: Sequence[Sequence[int]] | None = None,
                       routed_experts: Sequence[Tensor] | None = None) -> "ExperienceBatch":
        """Builds a batch on ``device`` from token lists; ``rollout_logprobs[i]`` (one per response token)
        land on the response positions. ``loss_masks[i]`` (one 0/1 per response token; None: all 1) keeps
        tokens the model did not generate (multi-turn observations) out of ``response_mask``.
        ``routed_experts[i]``: sample i's routing record, one row per token
        (:mod:`megarlhf.rollout.engines.routing`)."""
        if len(prompts) != len(responses) or not prompts:
            raise ValueError(f"ExperienceBatch.from_sequences: {len(prompts)} prompts and {len(responses)} "
                             f"responses (need the same non-zero number)")
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        width = max(lengths)
        ids, mask, lps = [], [], []
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            if len(prompt) < 1:
                raise ValueError(f"ExperienceBatch.from_sequences: prompt {i} is empty")
            pad = width - lengths[i]
            ids.append([*prompt, *response] + [pad_id] * pad)
            if loss_masks is not None and len(loss_masks[i]) != len(response):
                raise ValueError(f"ExperienceBatch.from_sequences: loss_masks[{i}] has {len(loss_masks[i])} "
                                 f"entries for {len(response)} response tokens")
            kept = [bool(m) for m in loss_masks[i]] if loss_masks is not None else [True] * len(response)
            mask.append([False] * len(prompt) + kept + [False] * pad)
            if rollout_logprobs is not None:
                if len(rollout_logprobs[i]) != len(response):
                    raise ValueError(f"ExperienceBatch.from_sequences: rollout_logprobs[{i}] has "
                                     f"{len(rollout_logprobs[i])} entries for {len(response)} response tokens")
                lps.append([0.0] * len(prompt) + [float(x) for x in rollout_logprobs[i]] + [0.0] * pad)
        routing = None if routed_experts is None else _stacked_records(routed_experts, lengths, width).to(device)
        # one host -> device copy per field
        return cls(torch.tensor(ids, dtype=torch.long, device=device),
                   torch.tensor(lengths, dtype=torch.long, device=device),
                   torch.tensor(mask, dtype=torch.bool, device=device),
                   rollout_logprobs=(torch.tensor(lps, dtype=torch.float32, device=device)
                                     if rollout_logprobs is not None else None),
                   group_ids=(torch.tensor(list(group_ids), dtype=torch.long, device=device)
                              if group_ids is not None else None),
                   routed_experts=routing, host_lengths=tuple(lengths))

    def select(self, rows: Tensor | Sequence[int]) -> "ExperienceBatch":
        """The rows ``rows`` (in that order), trimmed to their longest sequence."""
        order = rows.tolist() if isinstance(rows, Tensor) else [int(r) for r in rows]  # host: row numbers
        host_lengths = tuple(self.host_lengths[r] for r in order)
        rows = torch.tensor(order, dtype=torch.long, device=self.device)
        width = max(host_lengths, default=2)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        picked = {}
        for name, value in fields.items():
            if name == "host_lengths":
                picked[name] = host_lengths
            elif value is None:
                picked[name] = None
            elif name in ("lengths", "group_ids"):
                picked[name] = value[rows]
            else:
                picked[name] = value[rows, :width]
        return ExperienceBatch(**picked)

    def replace(self, **fields) -> "ExperienceBatch":
        """A copy with some fields replaced (e.g. ``batch.replace(old_logprobs=lp)``). Replacing the tokens or
        lengths checks the new batch in full, a new response mask is checked against the lengths (one
        device read), other fields by shape."""
        if "input_ids" in fields or "lengths" in fields:
            fields.setdefault("host_lengths", None)
            return dataclasses.replace(self, **fields)
        batch = dataclasses.replace(self, **fields)
        if "response_mask" in fields:
            batch._check_response_mask()
        return batch

    def require(self, where: str, *names: str) -> None:
        """Raises naming the per-token fields ``where`` needs that are missing."""
        missing = [name for name in names if getattr(self, name) is None]
        if missing:
            raise ValueError(f"{where}: the experience batch has no {', '.join(missing)} "
                             f"(fill them before calling {where})")


def _stacked_records(records: Sequence[Tensor], lengths: list[int], width: int) -> Tensor:
    """Per-sample routing records, right-padded with ``UNROUTED`` to [B, width, moe_layers, top_k]."""
    if len(records) != len(lengths):
        raise ValueError(f"ExperienceBatch.from_sequences: {len(records)} routing records for {len(lengths)} samples")
    shape = tuple(records[0].shape[1:]) if records else ()
    for i, (record, n) in enumerate(zip(records, lengths)):
        if record.dim() != 3 or tuple(record.shape) != (n, *shape):
            raise ValueError(f"ExperienceBatch.from_sequences: routed_experts[{i}] has shape {tuple(record.shape)}, "
                             f"expected ({n}, {', '.join(map(str, shape))}): one row per prompt + response token")
    # host: stacked there, then moved to the device in one copy like the other fields
    out = torch.full((len(records), width, *shape), UNROUTED, dtype=records[0].dtype)  # host: as above
    for i, (record, n) in enumerate(zip(records, lengths)):
        out[i, :n] = record
    return out
