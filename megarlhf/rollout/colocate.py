"""Colocate-and-offload: trainer models and the rollout engine take turns on the same devices.

:class:`ColocateScheduler` is a two-state machine that owns which side is resident:

    TRAINER_RESIDENT --enter_rollout()--> ENGINE_RESIDENT --exit_rollout()--> TRAINER_RESIDENT

``enter_rollout``: offload every trainer model that is not the sync source (critic, reference, ...) and
the actor's grads and optimizer state; wake the engine's weights; sync the actor into the engine
(verified, see :mod:`megarlhf.rollout.sync.weights`); offload the actor's params (they were the sync
source, so they go last); wake the engine's KV cache. ``exit_rollout``: the engine sleeps, every
offloaded storage comes back. Any other order raises :class:`ColocateStateError`.

Offload (:class:`OffloadedModel`) moves **storages**, not tensors. Megatron's DDP keeps parameters (with
the distributed optimizer) and gradients (``param.main_grad``) as views into contiguous buffers, and its
optimizers keep fp32 main params and shard views of those buffers; replacing a tensor would silently
break that aliasing. So every tensor of the model's training state is collected (module params, their
``.grad`` and ``.main_grad``; DDP's ``param_data`` / ``grad_data`` buffers; every inner torch optimizer's
params, their grads and its ``state`` tensors, through Megatron's ``ChainedOptimizer`` and wrappers),
deduplicated by underlying storage (views share one), each storage's bytes are copied into ONE compact
buffer per offload call (pinned CPU memory on GPU machines, a plain CPU buffer on CPU) and the storage
is resized to 0, which frees its memory. Onload resizes each storage back and copies the bytes in:
every view (param, main_grad, buffer, optimizer shard) stays a view of the same storage, and the round
trip is bit-exact by construction. Module buffers (rotary tables, ...) stay resident: they are small
and not training state. Megatron's own ``offload_grad_buffers`` / ``offload_to_cpu`` are not used:
they assume CUDA and cover only part of this state.

Storages that already live in host memory stay where they are (``OffloadedModel.skip_host_storages``,
on by default): the offload target is host memory, so on a CPU machine an offload would copy the
trainer state from host memory to host memory and free nothing. The state machine runs all the same
(and its copy path is tested on CPU with ``skip_host_storages=False``).

The actor is offloaded in two calls: first everything except the storages that back its parameters
(a storage shared by a parameter and other state, e.g. the distributed optimizer's fp32 shard of an
fp32 param buffer, belongs to the parameter phase), then, after the sync, the parameter storages.

Engine sleep / wake-up are vLLM's own (GPU only; on CPU vLLM has no sleep mode, so they do nothing and
only the trainer side moves). This module is the colocated mode; the disaggregated mode (separate
engine ranks, weights broadcast over a process group) is :mod:`megarlhf.rollout.disaggregated`.
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


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside ``optimizer``: itself, the members of a Megatron ``ChainedOptimizer``
    (``chained_optimizers``), or what a Megatron optimizer wraps (``.optimizer``); none for a stub."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for member in chained for inner in torch_optimizers(member)]
    inner = getattr(optimizer, "optimizer", None)
    if inner is None and getattr(optimizer, "is_stub_optimizer", False):
        return []  # Megatron's placeholder on a rank that owns no parameters
    if inner is None:
        raise TypeError(f"offload: {type(optimizer).__name__} is not a torch optimizer and wraps none")
    return torch_optimizers(inner)


def _ddp_buffers(module: torch.nn.Module) -> list:
    """Megatron DDP's contiguous param/grad buffers. ``vars`` because DDP's ``buffers`` list attribute
    shadows ``nn.Module.buffers()``."""
    found = []
    for sub in module.modules():
        for name in ("buffers", "expert_parallel_buffers"):
            value = vars(sub).get(name)
            if isinstance(value, list):
                found += [b for b in value if hasattr(b, "grad_data")]
    return found


def _param_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return list(module.parameters()) + [b.param_data for b in _ddp_buffers(module) if b.param_data is not None]


def _rest_tensors(module: torch.nn.Module, optimizers: list) -> list[torch.Tensor]:
    """Grads (``.grad``, ``.main_grad``, DDP grad buffers) and every optimizer tensor (params, grads, state)."""
    params = list(module.parameters())
    found = [b.grad_data for b in _ddp_buffers(module) if b.grad_data is not None]
    for opt in (inner for o in optimizers for inner in torch_optimizers(o)):
        params += [p for group in opt.param_groups for p in group["params"]]
        for state in opt.state.values():
            found += [v for v in state.values() if torch.is_tensor(v)]
    for p in params:
        found += [t for t in (p, p.grad, getattr(p, "main_grad", None)) if torch.is_tensor(t)]
    return found


def _storage_key(storage: torch.UntypedStorage) -> tuple[str, int]:
    return str(storage.device), storage.data_ptr()


def unique_storages(tensors, exclude=frozenset()) -> dict[tuple[str, int], torch.UntypedStorage]:
    """The distinct resident storages behind ``tensors`` (views share one; empty or already freed ones
    are skipped), keyed by (device, data pointer), minus the keys in ``exclude``."""
    found = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = _storage_key(storage)
        if storage.nbytes() > 0 and key not in exclude:
            found.setdefault(key, storage)
    return found


def _bytes_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def _synchronize(storages) -> None:
    if any(s.device.type == "cuda" for s in storages):
        torch.cuda.synchronize()  # the non-blocking copies must land before storages are freed / used


@dataclass
class _Phase:
    """One offload call: the compact buffer and, per freed storage, where its bytes lie in it."""

    buffer: torch.Tensor
    entries: list[tuple[torch.UntypedStorage, int, int]]  # (storage, offset, nbytes)


@dataclass
class OffloadedModel:
    """A model (and optionally its optimizers) whose training-state storages can be freed and restored."""

    name: str
    module: torch.nn.Module
    optimizers: list = field(default_factory=list)
    phases: list[_Phase] = field(default_factory=list)
    params_offloaded: bool = False
    rest_offloaded: bool = False
    skip_host_storages: bool = True  # storages in host memory already are where offload puts them

    @classmethod
    def of(cls, train_model, skip_host_storages: bool = True) -> "OffloadedModel":
        """From a :class:`megarlhf.learner.TrainModel` (its DDP model and Megatron optimizer, if any)."""
        optimizers = [] if train_model.optimizer is None else [train_model.optimizer]
        return cls(train_model.role, train_model.model, optimizers, skip_host_storages=skip_host_storages)

    def storages(self, *, params: bool = True, rest: bool = True) -> dict[tuple[str, int], torch.UntypedStorage]:
        """The resident storages an offload with these flags would free. A storage shared by a parameter
        and other state belongs to the parameters."""
        param_storages = unique_storages(_param_tensors(self.module))
        chosen = dict(param_storages) if params else {}
        if rest:
            chosen.update(unique_storages(_rest_tensors(self.module, self.optimizers), exclude=param_storages))
        if self.skip_host_storages:
            chosen = {key: s for key, s in chosen.items() if s.device.type != "cpu"}
        return chosen

    def offload(self, *, params: bool = True, rest: bool = True) -> int:
        """Frees the storages of the params (``params``) and/or of grads + optimizer state (``rest``),
        their bytes packed into one buffer; returns the bytes moved."""
        if (params and self.params_offloaded) or (rest and self.rest_offloaded):
            raise ColocateStateError(f"offload: the {'params' if params and self.params_offloaded else 'state'} "
                                     f"of {self.name} are already offloaded")
        storages = list(self.storages(params=params, rest=rest).values())
        fixed = [s for s in storages if not s.resizable()]
        if fixed:
            raise ValueError(f"offload: {len(fixed)} storage(s) of {self.name} cannot be resized (memory-mapped "
                             f"or borrowed tensors, e.g. {fixed[0].nbytes()} bytes on {fixed[0].device}); "
                             f"copy them into torch-allocated tensors first")
        total = sum(s.nbytes() for s in storages)
        pinned = any(s.device.type == "cuda" for s in storages)
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)  # host: the offload target
        entries, offset = [], 0
        for storage in storages:
            nbytes = storage.nbytes()
            buffer[offset:offset + nbytes].copy_(_bytes_view(storage, nbytes), non_blocking=pinned)
            entries.append((storage, offset, nbytes))
            offset += nbytes
        _synchronize(storages)
        for storage in storages:  # free only once every byte is copied
            storage.resize_(0)
        self.phases.append(_Phase(buffer, entries))
        self.params_offloaded = self.params_offloaded or params
        self.rest_offloaded = self.rest_offloaded or rest
        return total

    def onload(self) -> int:
        """Reallocates every freed storage on its device and copies its bytes back; returns the bytes moved."""
        pinned = any(storage.device.type == "cuda" for phase in self.phases for storage, *_ in phase.entries)
        for phase in self.phases:
            for storage, offset, nbytes in phase.entries:
                storage.resize_(nbytes)
                _bytes_view(storage, nbytes).copy_(phase.buffer[offset:offset + nbytes], non_blocking=pinned)
        _synchronize([storage for phase in self.phases for storage, *_ in phase.entries])
        moved = sum(phase.buffer.numel() for phase in self.phases)
        self.phases, self.params_offloaded, self.rest_offloaded = [], False, False
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

    def enter_rollout(self, sync_weights: bool = True) -> dict[str, float]:
        """TRAINER_RESIDENT -> ENGINE_RESIDENT: offload, wake weights, verified sync, wake KV cache.

        ``sync_weights=False`` keeps the weights the engine already has (a second generation round with
        an unchanged actor: the engine's sleep keeps its weights)."""
        self._require(Residency.TRAINER_RESIDENT, "enter_rollout")
        start = time.perf_counter()
        try:
            moved = sum(m.offload() for m in self.others) + self.actor.offload(params=False)
            self.engine.wake_up(["weights"])
            metrics = self.weight_sync.sync() if sync_weights else {}
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
