"""Colocate-and-offload: trainer models and the rollout engine take turns on the same devices.

:class:`ColocateScheduler` is a two-state machine that owns which side is resident:

    TRAINER_RESIDENT --enter_rollout()--> ENGINE_RESIDENT --exit_rollout()--> TRAINER_RESIDENT

``enter_rollout``: offload every trainer model that is not the sync source (critic, reference, ...) and
the actor's grads and optimizer state; wake the engine's weights; sync the actor into the engine
(verified, see :mod:`megarlhf.rollout.weight_sync`); offload the actor's params (they were the sync
source, so they go last); wake the engine's KV cache. ``exit_rollout``: the engine sleeps, every
offloaded tensor comes back. Any other order raises :class:`ColocateStateError`.

Offload (:class:`OffloadedModel`) packs a model's params, grads and optimizer-state tensors byte for
byte into ONE compact buffer (pinned CPU memory on GPU machines, a plain CPU buffer on CPU) and frees
the originals (``param.data`` becomes an empty tensor, grads and state entries are dropped); onload
allocates fresh tensors on the original device and copies the bytes back, so the round trip is
bit-exact. Engine sleep / wake-up are vLLM's own (GPU only; on CPU vLLM has no sleep mode, so they do
nothing and only the trainer side moves).

Covered state: module parameters and their ``.grad``, and the tensors of a torch optimizer's ``state``
(or of ``optimizer.optimizer`` when wrapped, as Megatron's optimizers are). Not covered: Megatron DDP's
contiguous grad buffers (``param.main_grad``) and a mixed-precision optimizer's fp32 main-param copies;
the trainer must use plain grads or release those buffers itself.

Only the colocated mode exists; a disaggregated mode (separate engine ranks, weights broadcast over a
process group) is not implemented.

Hand-written because it is megarlhf's scheduling policy; the memory moves are plain tensor copies.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch


class ColocateStateError(RuntimeError):
    """A scheduler transition was requested from the wrong state."""


class Residency(enum.Enum):
    TRAINER_RESIDENT = "trainer_resident"
    ENGINE_RESIDENT = "engine_resident"


@dataclass
class _Slot:
    """Where one offloaded tensor lives in the buffer and how to put it back."""

    kind: str  # "param", "grad" or "state"
    owner: object  # the parameter (param, grad) or the optimizer-state dict (state)
    key: str | None
    source: torch.Tensor  # this tensor's bytes: a view into the model's offload buffer
    dtype: torch.dtype
    shape: torch.Size
    device: torch.device


def _torch_optimizer(optimizer):
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"offload: {type(optimizer).__name__} is not a torch optimizer and wraps none")
    return inner


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


@dataclass
class OffloadedModel:
    """A model (and optionally its optimizers) that can be packed into one buffer and restored."""

    name: str
    module: torch.nn.Module
    optimizers: list = field(default_factory=list)
    slots: list[_Slot] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)  # one per offload call (actor: two)
    params_offloaded: bool = False

    def _collect(self, include_params: bool, include_rest: bool) -> list[tuple[str, object, str | None, torch.Tensor]]:
        found, seen = [], set()
        for param in self.module.parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            if include_params:
                found.append(("param", param, None, param.data))
            if include_rest and param.grad is not None:
                found.append(("grad", param, None, param.grad))
        if include_rest:
            for opt in self.optimizers:
                for state in _torch_optimizer(opt).state.values():
                    found += [("state", state, k, v) for k, v in sorted(state.items()) if torch.is_tensor(v)]
        return found

    def offload(self, *, params: bool = True, rest: bool = True) -> int:
        """Moves params (``params``) and/or grads + optimizer state (``rest``) into one buffer; returns bytes."""
        if params and self.params_offloaded:
            raise ColocateStateError(f"offload: the params of {self.name} are already offloaded")
        found = self._collect(params, rest)
        total = sum(t.numel() * t.element_size() for *_, t in found)
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        offset = 0
        for kind, owner, key, tensor in found:
            nbytes = tensor.numel() * tensor.element_size()
            source = buffer[offset:offset + nbytes]
            source.copy_(_bytes_of(tensor))
            self.slots.append(_Slot(kind, owner, key, source, tensor.dtype, tensor.shape, tensor.device))
            offset += nbytes
        for kind, owner, key, tensor in found:  # free the originals only once everything is copied
            if kind == "param":
                owner.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            elif kind == "grad":
                owner.grad = None
            else:
                owner[key] = None
        self.buffers.append(buffer)
        self.params_offloaded = self.params_offloaded or params
        return total

    def onload(self) -> int:
        """Puts every offloaded tensor back on its device, bit for bit; returns the bytes moved."""
        for slot in sorted(self.slots, key=lambda s: s.kind != "param"):  # a grad needs its param's shape
            tensor = torch.empty(slot.shape, dtype=slot.dtype, device=slot.device)
            if tensor.numel():
                tensor.view(-1).view(torch.uint8).copy_(slot.source)
            if slot.kind == "param":
                slot.owner.data = tensor
            elif slot.kind == "grad":
                slot.owner.grad = tensor
            else:
                slot.owner[slot.key] = tensor
        moved = sum(b.numel() for b in self.buffers)
        self.slots, self.buffers, self.params_offloaded = [], [], False
        return moved


class ColocateScheduler:
    """Owns residency of the actor (the sync source), the other trainer models and the engine."""

    def __init__(self, engine, weight_sync, actor: OffloadedModel, others: list[OffloadedModel] = ()):
        self.engine, self.weight_sync, self.actor, self.others = engine, weight_sync, actor, list(others)
        self.state = Residency.TRAINER_RESIDENT

    def _require(self, state: Residency, action: str) -> None:
        if self.state is not state:
            raise ColocateStateError(f"colocate scheduler: cannot {action} while {self.state.value} "
                                     f"(allowed only while {state.value})")

    def enter_rollout(self) -> dict[str, float]:
        """TRAINER_RESIDENT -> ENGINE_RESIDENT: offload, wake weights, verified sync, wake KV cache."""
        self._require(Residency.TRAINER_RESIDENT, "enter_rollout")
        start = time.perf_counter()
        try:
            moved = sum(m.offload() for m in self.others) + self.actor.offload(params=False)
            self.engine.wake_up(["weights"])
            metrics = self.weight_sync.sync(self.actor.module)
            moved += self.actor.offload(params=True, rest=False)
            self.engine.wake_up(["kv_cache"])
        except BaseException:
            self._onload_all()  # leave the trainer whole so the error can be handled or reported
            self.engine.sleep()
            raise
        self.state = Residency.ENGINE_RESIDENT
        metrics.update({"colocate/offload_bytes": float(moved), "time/enter_rollout_s": time.perf_counter() - start})
        return metrics

    def exit_rollout(self) -> dict[str, float]:
        """ENGINE_RESIDENT -> TRAINER_RESIDENT: the engine sleeps, trainer state comes back."""
        self._require(Residency.ENGINE_RESIDENT, "exit_rollout")
        start = time.perf_counter()
        self.engine.sleep()
        moved = self._onload_all()
        self.state = Residency.TRAINER_RESIDENT
        return {"colocate/onload_bytes": float(moved), "time/exit_rollout_s": time.perf_counter() - start}

    def _onload_all(self) -> int:
        return sum(m.onload() for m in [self.actor, *self.others])
