"""Atomic Megatron distributed checkpoints of a model, loadable at any tensor/pipeline-parallel layout (an
MoE model's optimizer state only at the expert-parallel size it was saved at; its weights at any).

A checkpoint directory holds

* Megatron-Core ``dist_checkpointing`` files in the ``torch_dist`` format (``metadata.json``,
  ``.metadata``, ``__*_*.distcp``, ``common.pt``), and
* ``megarlhf_checkpoint.json``, megarlhf's completion marker, written last: format version, megarlhf
  version, the layout it was saved from, a summary of the model's TransformerConfig, and the caller's
  JSON ``metadata`` (step, HF config, ...).

Resharding. Every parameter goes in as a Megatron ``ShardedTensor`` with its *global* shape and offset:
tensor-parallel shards carry their slice of the full tensor and pipeline stages their global layer
indices, so the checkpoint holds each full tensor once and any TP/PP/DP layout reads its own slices back
(the model-only path needs no special sharding type; ``fully_reshardable`` is an optimizer setting).
Vocab-parallel embeddings and output layers are padded per TP size; Megatron marks them
``allow_shape_mismatch``, so a checkpoint saved with one padding loads with another (padding rows are 0).

Atomicity. All ranks write into ``<dir>.tmp-<token>``; rank 0 then writes the marker, fsyncs it and renames
the directory to its final name. A crash or kill at any point before the rename leaves the previous
checkpoint untouched and nothing under the final name; a loader refuses a directory without the marker.
Overwriting moves the old checkpoint aside to ``<dir>.old-<token>`` before the rename and deletes it after;
a crash between those two renames (microseconds) leaves the old checkpoint complete under that name, and
the "missing checkpoint" error points at it. Leftover ``.tmp-``/``.old-`` siblings of a later save's target
are removed by that save (an ``.old-`` one only once the final directory is complete).

Why hand-written: ``dist_checkpointing`` writes and reshards the tensors, but writes straight into the
target directory (a crash leaves it half-written) and has no notion of "complete"; the publish protocol,
the marker and the clear errors are megarlhf's.

``extra_state``: plain picklable objects (step counters, sampler state, ...) that are the same on every
rank; they go into ``common.pt`` (rank 0's copy) and come back from :func:`load_checkpoint`.

Training state (optional, for resuming a run). With ``optimizer``/``scheduler`` the Megatron optimizer's
state and the ``OptimizerParamScheduler``'s state are saved next to the weights: a plain optimizer through
its own ``sharded_state_dict``, the DistributedOptimizer in the ``fully_reshardable`` format (the default
``fully_sharded_model_space`` cannot be saved: ``ShardedTensor.flattened_range is not supported``), so
optimizer state reshards across TP/PP/DP like the weights. ``companions`` adds further models with their
own optimizers (a PPO critic): their checkpoint keys are prefixed ``<name>.``, while the main model keeps
the model-only key layout, so every reader of model checkpoints (:func:`load_checkpoint` without an
optimizer, the HF export) also reads the main model of a training checkpoint. ``rank_state`` is a
per-rank object (RNG states) written to ``rank_state/rank<r>.pt`` inside the temporary directory, so it
is published atomically with the rest; :func:`load_rank_state` reads this rank's copy back.

The DistributedOptimizer with torch's own Adam (always the case without Transformer Engine or apex) has
four loading bugs in megatron-core 0.19.2, each worked around here: (1) a never-stepped optimizer cannot
build its loading state dict (``len(steps) == 1`` assertion): its state is primed first by one step at
lr 0 (parameters unchanged); (2) ``fully_reshardable`` loading raises ``KeyError: 'step'``: the
per-parameter setter is told that 'step' is not in the loaded tensors; (3) with fp32 parameters the main
parameter is a view of a leaf that requires grad, so its in-place copy raises outside ``no_grad``: the
``dp_reshardable`` loader has that bug, the ``fully_reshardable`` one used here runs under ``no_grad``
itself (checked by disabling ours), and megarlhf loads under ``torch.no_grad()`` as well; (4) after
loading, every parameter's 'step' is the same tensor, which Adam then advances once per parameter per
step (wrong bias correction): each parameter gets its own copy. A never-stepped optimizer is saved
primed and marked ``fresh``; loading such a checkpoint empties the state again, so the next step is a
first step as in an uninterrupted run.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from megarlhf import __version__ as megarlhf_version
from megarlhf.checkpoint.async_save import AsyncCheckpointWriter
from megarlhf.core.errors import CheckpointError

MARKER_FILE = "megarlhf_checkpoint.json"
FORMAT = "megarlhf.dist_checkpoint"
FORMAT_VERSION = 1
RANK_STATE_DIR = "rank_state"
# Megatron's DistributedOptimizer checkpoint format that reshards across TP, PP and DP.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
MCORE_ASYNC_NOTICE = "MCore's async save is deprecated"


class _DropSyncSaveAsyncNotice(logging.Filter):
    """megarlhf saves synchronously (``dist_checkpointing.save``). In megatron-core 0.19 the synchronous
    ``TorchDistSaveShardedStrategy.save`` runs through Megatron's own async machinery
    (``async_save(..., async_strategy="mcore")`` then ``execute_sync()``), which logs that *async* saving
    through MCore is deprecated in favour of NVRx (nvidia-resiliency-ext). For a synchronous save that notice
    is about something we do not do; an async save through the built-in writer is announced by
    :class:`AsyncCheckpointWriter` in our own words instead. Only it is dropped, the logger's other messages pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return MCORE_ASYNC_NOTICE not in record.getMessage()


_SYNC_SAVE_NOTICE_FILTER = _DropSyncSaveAsyncNotice()
# TransformerConfig fields that decide tensor shapes: a mismatch is reported before Megatron's own error.
_SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "gated_linear_unit", "add_qkv_bias", "qk_layernorm")


@dataclass
class Companion:
    """A further model saved in the same checkpoint, with its optimizer and lr scheduler (None: not saved)."""

    model: torch.nn.Module
    optimizer: Any = None
    scheduler: Any = None


def _require_distributed(action: str) -> None:
    if not dist.is_initialized():
        raise CheckpointError(f"{action} needs torch.distributed and Megatron's parallel state: call "
                              "parallel.runtime.init_parallel(...) first (it works in a single process too)")


def _rank() -> int:
    return dist.get_rank()


def _barrier() -> None:
    if dist.get_world_size() > 1:
        dist.barrier()


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (collective; also a barrier)."""
    box = [value if _rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _shared_token() -> str:
    """A name suffix chosen by rank 0 and known to every rank."""
    return _from_rank0(f"{os.getpid()}-{uuid.uuid4().hex[:8]}" if _rank() == 0 else None)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_durably(path: Path, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(path.parent)


def _siblings(final: Path, kind: str) -> list[Path]:
    """Directories named ``<final>.<kind>-*`` next to ``final`` (kind: "tmp" or "old")."""
    if not final.parent.is_dir():
        return []
    prefix = f"{final.name}.{kind}-"
    return sorted(p for p in final.parent.iterdir() if p.name.startswith(prefix) and p.is_dir())


def _remove_leftovers(final: Path) -> None:
    """Deletes partial saves of ``final`` and old copies that a complete ``final`` has replaced."""
    for partial in _siblings(final, "tmp"):
        shutil.rmtree(partial)
    if is_complete_checkpoint(final):
        for old in _siblings(final, "old"):
            shutil.rmtree(old)


def _publish(tmp: Path, final: Path, token: str) -> None:
    """Gives the finished ``tmp`` directory its final name (rank 0 only)."""
    if final.exists():
        aside = final.with_name(f"{final.name}.old-{token}")
        os.rename(final, aside)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
        shutil.rmtree(aside)
    else:
        os.rename(tmp, final)
        _fsync_dir(final.parent)


def _model_summary(model: torch.nn.Module) -> dict:
    config = getattr(model, "config", None)
    summary = {field: getattr(config, field) for field in _SHAPE_FIELDS if hasattr(config, field)}
    if hasattr(config, "params_dtype"):
        summary["params_dtype"] = str(config.params_dtype).removeprefix("torch.")
    return summary


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    layout = {"world_size": dist.get_world_size()}
    if ps.model_parallel_is_initialized():
        layout.update(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                      pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                      data_parallel_size=ps.get_data_parallel_world_size(),
                      expert_model_parallel_size=ps.get_expert_model_parallel_world_size())
    return layout


def _inner_optimizers(optimizer) -> list:
    """The Megatron optimizers inside ``optimizer`` (a ChainedOptimizer holds one per parameter group set)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(megatron_optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(megatron_optimizer, DistributedOptimizer)


def _is_fresh(optimizer) -> bool:
    """True when no inner optimizer holds state yet (no step was taken)."""
    return all(len(inner.optimizer.state) == 0 for inner in _inner_optimizers(optimizer))


def _prime(optimizer) -> None:
    """Gives a never-stepped DistributedOptimizer its state (bug 1): one step with zero gradients at lr 0
    (Megatron's own initialiser), which leaves the parameters exactly as they are."""
    for inner in _inner_optimizers(optimizer):
        if not _is_distributed(inner) or len(inner.optimizer.state):
            continue
        groups = inner.optimizer.param_groups
        saved_lr = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = 0.0
        try:
            inner._init_optimizer_states_with_dummy_values()
        finally:
            for group, lr in zip(groups, saved_lr):
                group["lr"] = lr


def _clear_state(optimizer) -> None:
    for inner in _inner_optimizers(optimizer):
        inner.optimizer.state.clear()


def _optimizer_kind(optimizer) -> str:
    return "distributed" if any(_is_distributed(inner) for inner in _inner_optimizers(optimizer)) else "plain"


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers: the wrappers would add ``module.`` to every key,
    and a checkpoint must not depend on how the model was wrapped when it was saved."""
    from model_providers.hf_checkpoint import unwrap

    return unwrap(model)


def _part_sharded_state(model, optimizer, scheduler, prefix: str, is_loading: bool) -> dict:
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

    model_state = _unwrapped(model).sharded_state_dict()
    if prefix:
        add_prefix_for_sharding(model_state, prefix)
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                          metadata=dict(_OPTIMIZER_METADATA))
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    return state


def _part_marker(model, optimizer, scheduler, fresh: bool) -> dict:
    return {"model": _model_summary(model), "scheduler": scheduler is not None,
            "optimizer": None if optimizer is None else {"kind": _optimizer_kind(optimizer), "fresh": fresh}}


def save_checkpoint(directory: str | os.PathLike, model: torch.nn.Module, extra_state: dict | None = None, *,
                    metadata: dict | None = None, files: Mapping[str, str | os.PathLike] | None = None,
                    overwrite: bool = False, optimizer: Any = None, scheduler: Any = None,
                    companions: Mapping[str, Companion] | None = None, rank_state: Any = None,
                    writer: AsyncCheckpointWriter | None = None) -> Path:
    """Saves this rank's shards of ``model`` as a distributed checkpoint at ``directory``, atomically.

    Collective: every rank of the job calls it with its own model stage/shard. ``model`` is anything with
    Megatron's ``sharded_state_dict()`` (a GPTModel, or Megatron DDP around one). ``metadata`` must be
    JSON-serialisable and lands in the marker file; ``extra_state`` see the module docstring. ``files`` maps
    relative paths inside the checkpoint to files that rank 0 copies in before publishing. An existing
    checkpoint at ``directory`` is an error unless ``overwrite``. ``optimizer`` / ``scheduler`` (the model's
    Megatron optimizer and OptimizerParamScheduler), ``companions`` and ``rank_state`` (tensors, numbers,
    strings, tuples, lists and dicts only) see the module docstring. With ``writer`` the tensors are written
    in the background and the checkpoint appears at the returned path only when ``writer`` publishes it
    (:mod:`megarlhf.checkpoint.async_save`); ``model`` may change as soon as this returns. Returns the final path.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    torch_strategy.logger.addFilter(_SYNC_SAVE_NOTICE_FILTER)  # once: a Filterer keeps one of each
    _require_distributed("save_checkpoint")
    final = Path(directory).absolute()
    try:
        json.dumps(metadata)
    except TypeError as err:
        raise CheckpointError(f"checkpoint metadata for {final} is not JSON-serialisable: {err}") from None
    if final.exists() and not overwrite:
        raise CheckpointError(f"{final} already exists; pass overwrite=True to replace it")
    missing = [str(source) for source in (files or {}).values() if not Path(source).is_file()]
    if missing:
        raise CheckpointError(f"files to add to checkpoint {final} do not exist: {missing}")
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"{final} exists and is not a directory")
    companions = dict(companions or {})
    bad = [name for name in companions if not name.isidentifier()]
    if bad:
        raise CheckpointError(f"companion model names must be identifiers, got {bad}")
    token = _shared_token()
    tmp = final.with_name(f"{final.name}.tmp-{token}")
    if _rank() == 0:
        _remove_leftovers(final)
        tmp.mkdir(parents=True)
    _barrier()
    parts = {"": Companion(model, optimizer, scheduler), **companions}
    fresh = {name: part.optimizer is not None and _is_fresh(part.optimizer) for name, part in parts.items()}
    markers = {name: _part_marker(part.model, part.optimizer, part.scheduler, fresh[name])
               for name, part in parts.items()}
    try:
        for name, part in parts.items():
            if fresh[name]:
                _prime(part.optimizer)  # a fresh DistributedOptimizer cannot build its state dict (bug 1)
        state = _part_sharded_state(model, optimizer, scheduler, "", is_loading=False)
        state["companions"] = {name: _part_sharded_state(part.model, part.optimizer, part.scheduler, f"{name}.",
                                                         is_loading=False) for name, part in companions.items()}
        if extra_state is not None:
            state["extra_state"] = extra_state
        if writer is None:
            dist_checkpointing.save(state, str(tmp))
        else:
            request = dist_checkpointing.save(state, str(tmp), async_sharded_save=True,
                                              async_strategy=writer.strategy)
    finally:
        for name, part in parts.items():
            if fresh[name]:
                _clear_state(part.optimizer)
    if rank_state is not None:
        (tmp / RANK_STATE_DIR).mkdir(exist_ok=True)
        torch.save(rank_state, tmp / RANK_STATE_DIR / f"rank{_rank()}.pt")
    if _rank() == 0:  # now, not at publication: the files as they are when the save is made
        for relative, source in (files or {}).items():
            (tmp / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, tmp / relative)
    main = markers.pop("")
    marker = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "megarlhf_version": megarlhf_version,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "saved_with": _layout(), "model": main["model"], "optimizer": main["optimizer"],
        "scheduler": main["scheduler"], "companions": markers, "rank_state": rank_state is not None,
        "has_extra_state": extra_state is not None, "metadata": metadata or {},
    }

    def publish() -> None:
        """After every rank's tensors are written: rank 0 writes the marker, then renames. A failure there is
        raised on every rank (the others would otherwise wait at a barrier until rank 0's process is gone)."""
        _barrier()
        failure = None
        if _rank() == 0:
            try:
                _write_json_durably(tmp / MARKER_FILE, marker)
                _publish(tmp, final, token)
            except Exception as err:
                failure = err
        message = _from_rank0(None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        if message is not None:
            raise CheckpointError(f"rank 0 could not publish checkpoint {final} ({message}); it was not published")

    if writer is None:
        publish()
    else:
        writer.schedule(request, final, publish)
    return final


def _missing_message(path: Path) -> str:
    message = f"no checkpoint at {path}: the directory does not exist"
    moved = [p for p in _siblings(path, "old") if is_complete_checkpoint(p)]
    if moved:
        message += (f"; an interrupted overwrite left the previous complete checkpoint at {moved[-1]} "
                    "(rename it back to use it)")
    return message


def checkpoint_metadata(directory: str | os.PathLike) -> dict:
    """The marker of the complete checkpoint at ``directory``; raises :class:`CheckpointError` otherwise."""
    path = Path(directory).absolute()
    if not path.exists():
        raise CheckpointError(_missing_message(path))
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory (it is a file)")
    marker = path / MARKER_FILE
    if not marker.is_file():
        reason = ("it is a partial save (interrupted before completion)" if ".tmp-" in path.name else
                  "the save did not finish, or it was not written by megarlhf.checkpoint.save_checkpoint")
        raise CheckpointError(f"incomplete checkpoint at {path}: {MARKER_FILE} is missing ({reason})")
    try:
        info = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"incomplete checkpoint at {path}: {MARKER_FILE} is unreadable ({err})") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointError(f"{marker} is not a megarlhf checkpoint marker (format {info.get('format')!r})"
                              if isinstance(info, dict) else f"{marker} is not a megarlhf checkpoint marker")
    if info.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint at {path} has format version {info['format_version']}; this "
                              f"megarlhf reads up to version {FORMAT_VERSION}")
    return info


def is_complete_checkpoint(directory: str | os.PathLike) -> bool:
    """True when ``directory`` holds a complete megarlhf checkpoint (never raises)."""
    try:
        checkpoint_metadata(directory)
    except CheckpointError:
        return False
    return True


def _check_model_matches(info: dict, model: torch.nn.Module, path: Path) -> None:
    saved, current = info.get("model", {}), _model_summary(model)
    diffs = [f"{k}: checkpoint {saved[k]!r}, model {current[k]!r}" for k in _SHAPE_FIELDS
             if k in saved and k in current and saved[k] != current[k]]
    if diffs:
        raise CheckpointError(f"checkpoint at {path} does not fit this model ({'; '.join(diffs)})")


@contextmanager
def _step_not_in_loaded_tensors(inner):
    """Bug 2: ``_set_main_param_and_optimizer_states`` copies every state tensor of the live optimizer,
    'step' included, but the fully_reshardable loader leaves 'step' out of the loaded tensors (it travels in
    the param groups). Marking it absent (None is skipped by the setter) lets the copy go through."""
    original = inner._set_main_param_and_optimizer_states
    inner._set_main_param_and_optimizer_states = lambda param, tensors: original(param, {"step": None, **tensors})
    try:
        yield
    finally:
        del inner._set_main_param_and_optimizer_states


def _own_step_tensors(inner) -> None:
    """Bug 4: Megatron gives every parameter the same 'step' tensor, which torch's Adam advances once per
    parameter per step; each parameter gets its own copy."""
    for state in inner.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def _load_optimizer(optimizer, loaded) -> None:
    inners = _inner_optimizers(optimizer)
    states = [loaded] if len(inners) == 1 else [state for _, state in sorted(loaded.items())]
    for inner, state in zip(inners, states):
        if not _is_distributed(inner):
            inner.load_state_dict(state)
            _own_step_tensors(inner)
            continue
        param_state = state.pop("param_state", None)
        sharding = state.pop("param_state_sharding_type", None)
        inner.load_state_dict(state)  # param groups (lr, betas, step) without the parameter state
        _own_step_tensors(inner)
        if param_state is None:
            continue
        if sharding != "fully_reshardable":
            raise CheckpointError(f"optimizer state in sharding format {sharding!r}; megarlhf writes "
                                  "'fully_reshardable'")
        with torch.no_grad(), _step_not_in_loaded_tensors(inner):  # bug 3 (see the module docstring), bug 2
            inner.load_parameter_state_from_fully_reshardable(param_state)
    if len(inners) > 1:
        optimizer._synchronize_steps()
        for inner in inners:
            _own_step_tensors(inner)


def _check_parts_match(info: dict, path: Path, optimizer, scheduler, companions: dict) -> None:
    """Every optimizer, scheduler and companion asked for must be in the checkpoint (and the other way
    round for companions: a checkpoint of actor + critic does not resume an actor-only run)."""
    problems = []
    if optimizer is not None and not info.get("optimizer"):
        problems.append("it holds no optimizer state for the model")
    if scheduler is not None and not info.get("scheduler"):
        problems.append("it holds no lr scheduler state for the model")
    saved = info.get("companions", {})
    if set(saved) != set(companions):
        problems.append(f"it holds the companion models {sorted(saved)}, this run has {sorted(companions)}")
    for name in set(saved) & set(companions):
        part = companions[name]
        if part.optimizer is not None and not saved[name].get("optimizer"):
            problems.append(f"it holds no optimizer state for {name!r}")
        if part.scheduler is not None and not saved[name].get("scheduler"):
            problems.append(f"it holds no lr scheduler state for {name!r}")
    wants_optimizer = optimizer is not None or any(part.optimizer is not None for part in companions.values())
    saved_ep = info.get("saved_with", {}).get("expert_model_parallel_size")  # None: not recorded (older saves)
    ep = _layout().get("expert_model_parallel_size", 1)
    if wants_optimizer and saved_ep is not None and saved_ep != ep:
        # Megatron gives the experts an optimizer of their own when EP > 1 (a chained optimizer, whose state
        # is saved under other keys), so optimizer state does not carry over to another EP size
        problems.append(f"it was saved at expert_model_parallel_size={saved_ep}, this run has {ep}, and an MoE "
                        f"model's optimizer state is laid out per expert-parallel size: resume at "
                        f"expert_model_parallel_size={saved_ep}, or start a new run from the checkpoint's weights "
                        f"(weights alone load at any layout, e.g. megarlhf convert megatron-to-hf)")
    if problems:
        raise CheckpointError(f"checkpoint at {path} does not fit this run: {'; '.join(problems)}")


def _apply_part(loaded: dict, part: Companion, marker: dict, strict: bool) -> None:
    _unwrapped(part.model).load_state_dict(loaded["model"], strict=strict)
    if part.optimizer is not None:
        _load_optimizer(part.optimizer, loaded["optimizer"])
        if (marker.get("optimizer") or {}).get("fresh"):
            _clear_state(part.optimizer)  # saved before its first step: the next step is a first step again
    if part.scheduler is not None:
        part.scheduler.load_state_dict(loaded["scheduler"])


def load_checkpoint(directory: str | os.PathLike, model: torch.nn.Module, *, strict: bool = True,
                    optimizer: Any = None, scheduler: Any = None,
                    companions: Mapping[str, Companion] | None = None) -> dict | None:
    """Loads the checkpoint at ``directory`` into ``model`` (this rank's shards, any TP/PP layout).

    Collective. Returns the ``extra_state`` it was saved with (None if none). Every parameter the model
    expects must be in the checkpoint; with ``strict`` the model must also accept every loaded entry.
    ``optimizer``, ``scheduler`` and ``companions`` (as saved by :func:`save_checkpoint`) are loaded in
    place too; they must all be in the checkpoint, and a checkpoint with companions needs them all.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import StrictHandling

    _require_distributed("load_checkpoint")
    path = Path(directory).absolute()
    info = checkpoint_metadata(path)
    _check_model_matches(info, model, path)
    companions = dict(companions or {})
    if optimizer is not None or scheduler is not None or companions:
        _check_parts_match(info, path, optimizer, scheduler, companions)
    for name, part in companions.items():
        _check_model_matches(info["companions"][name], part.model, path)
    parts = {"": Companion(model, optimizer, scheduler), **companions}
    for part in parts.values():
        if part.optimizer is not None:
            _prime(part.optimizer)  # a fresh DistributedOptimizer cannot build its loading state dict (bug 1)
    request = _part_sharded_state(model, optimizer, scheduler, "", is_loading=True)
    if companions:
        request["companions"] = {name: _part_sharded_state(part.model, part.optimizer, part.scheduler, f"{name}.",
                                                           is_loading=True) for name, part in companions.items()}
    try:
        # RAISE_UNEXPECTED: a model tensor absent from the checkpoint is an error; checkpoint entries the
        # caller does not ask for (e.g. optimizer state) are fine.
        loaded = dist_checkpointing.load(request, str(path), strict=StrictHandling.RAISE_UNEXPECTED)
    except CheckpointingException as err:
        raise CheckpointError(f"cannot load checkpoint at {path} into this model: {err}") from err
    _apply_part(loaded, parts[""], info, strict)
    for name, part in companions.items():
        _apply_part(loaded["companions"][name], part, info["companions"][name], strict)
    return loaded.get("extra_state") if info.get("has_extra_state") else None


def load_rank_state(directory: str | os.PathLike) -> Any:
    """This rank's ``rank_state`` from the complete checkpoint at ``directory``.

    Requires the world size the checkpoint was saved with (rank r reads the object rank r wrote).
    """
    _require_distributed("load_rank_state")
    path = Path(directory).absolute()
    info = checkpoint_metadata(path)
    if not info.get("rank_state"):
        raise CheckpointError(f"checkpoint at {path} holds no per-rank state")
    saved_world, world = info["saved_with"]["world_size"], dist.get_world_size()
    if saved_world != world:
        raise CheckpointError(f"checkpoint at {path} holds per-rank state of {saved_world} ranks; this job has "
                              f"{world}: per-rank state (RNG streams) only loads at the same world size")
    file = path / RANK_STATE_DIR / f"rank{_rank()}.pt"
    if not file.is_file():
        raise CheckpointError(f"incomplete checkpoint at {path}: {file.name} is missing from {RANK_STATE_DIR}/")
    return torch.load(file, weights_only=True)
