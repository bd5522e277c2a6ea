"""Atomic Megatron distributed checkpoints of a model, loadable at any tensor/pipeline-parallel layout (a
distributed optimizer's state at any data-parallel size, and at any tensor/pipeline layout when saved
``fully_reshardable``; an MoE model's only at the expert-parallel size it was saved at; weights at any).

A checkpoint directory holds

* Megatron-Core ``dist_checkpointing`` files in the ``torch_dist`` format (``metadata.json``,
  ``.metadata``, ``__*_*.distcp``, ``common.pt``), and
* ``megarlhf_checkpoint.json``, megarlhf's completion marker, written last: format version, megarlhf
  version, the layout it was saved from, a summary of the model's TransformerConfig, and the caller's
  JSON ``metadata`` (step, HF config, ...).

Resharding. Every parameter goes in as a Megatron ``ShardedTensor`` with its *global* shape and offset:
tensor-parallel shards carry their slice of the full tensor and pipeline stages their global layer
indices, so the checkpoint holds each full tensor once and any TP/PP/DP layout reads its own slices back
(the model-only path needs no special sharding type; the optimizer's format is its own setting).
Vocab-parallel embeddings and output layers are padded per TP size; Megatron marks them
``allow_shape_mismatch``, so a checkpoint saved with one padding loads with another (padding rows are 0).

Atomicity. All ranks write into ``<dir>.tmp-<token>``; rank 0 then writes the marker, fsyncs it and renames
the directory to its final name. A crash or kill at any point before the rename leaves the previous
checkpoint untouched and nothing under the final name; a loader refuses a directory without the marker.
Overwriting moves the old checkpoint aside to ``<dir>.old-<token>`` before the rename and deletes it after;
a crash between those two renames (microseconds) leaves the old checkpoint complete under that name, and
the "missing checkpoint" error points at it. Leftover ``.tmp-``/``.old-`` siblings of a later save's target
are removed by that save (an ``.old-`` one only once the final directory is complete).

``extra_state``: plain picklable objects (step counters, sampler state, ...) that are the same on every
rank; they go into ``common.pt`` (rank 0's copy) and come back from :func:`load_checkpoint`.

Training state (optional, for resuming a run: a :class:`TrainingState`). With its ``optimizer`` and
``scheduler`` the Megatron optimizer's state and the ``OptimizerParamScheduler``'s state are saved next to
the weights: a plain optimizer through
its own ``sharded_state_dict``, the DistributedOptimizer in ``TrainingState.optimizer_format``:
``dp_reshardable`` (each data-parallel rank writes its shard in parallel; reshards across DP) or
``fully_reshardable`` (gathered onto one rank; reshards across TP/PP/DP like the weights), recorded in the
marker and read back in the same format (Megatron's default ``fully_sharded_model_space`` cannot be saved:
``ShardedTensor.flattened_range is not supported``). A resume that the saved format cannot serve is
refused first, naming the setting (:mod:`megarlhf.checkpoint.fit`). ``companions`` adds further models with their
own optimizers (a PPO critic): their checkpoint keys are prefixed ``<name>.``, while the main model keeps
the model-only key layout, so every reader of model checkpoints (:func:`load_checkpoint` without an
optimizer, the HF export) also reads the main model of a training checkpoint. ``rank_state`` is a
per-rank object (RNG states) written to ``rank_state/rank<r>.pt`` inside the temporary directory, so it
is published atomically with the rest; :func:`load_rank_state` reads this rank's copy back.

Optimizer state goes through :mod:`megarlhf.checkpoint.optimizer_state` (Megatron's loading bugs).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import queue
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from megarlhf import __version__ as megarlhf_version
from megarlhf.checkpoint import publish
from megarlhf.checkpoint.async_save import AsyncCheckpointWriter
from megarlhf.checkpoint.fit import check_parts_match, current_layout
from megarlhf.checkpoint.optimizer_state import (SAVED_BEFORE_FORMATS, clear_state, is_fresh, load_optimizer,
                                                 optimizer_kind, prime, sharding_metadata)
from megarlhf.core.outputs import check_replaceable
from megarlhf.core.errors import CheckpointError

MARKER_FILE = "megarlhf_checkpoint.json"
FORMAT = "megarlhf.dist_checkpoint"
FORMAT_VERSION = 1
RANK_STATE_DIR = "rank_state"
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


@dataclass
class TrainingState:
    """What a run saves beside a model to resume it: the model's Megatron optimizer and lr scheduler,
    further models with theirs (``companions``, keyed by identifier names), and ``rank_state``, a per-rank
    object (RNG states: tensors, numbers, strings, tuples, lists and dicts only)."""

    optimizer: Any = None
    scheduler: Any = None
    companions: Mapping[str, Companion] = field(default_factory=dict)
    rank_state: Any = None
    optimizer_format: str = "dp_reshardable"  # a DistributedOptimizer's (checkpoint.optimizer_format)


def _require_distributed(action: str) -> None:
    if not dist.is_initialized():
        raise CheckpointError(f"{action} needs torch.distributed and Megatron's parallel state: call "
                              "parallel.runtime.init_parallel(...) first (it works in a single process too)")


def _remove_leftovers(final: Path) -> None:
    """Deletes partial saves of ``final`` and old copies that a complete ``final`` has replaced."""
    for partial in publish.siblings(final, "tmp"):
        shutil.rmtree(partial)
    if is_complete_checkpoint(final):
        for old in publish.siblings(final, "old"):
            shutil.rmtree(old)


def _model_summary(model: torch.nn.Module) -> dict:
    config = getattr(model, "config", None)
    summary = {field: getattr(config, field) for field in _SHAPE_FIELDS if hasattr(config, field)}
    if hasattr(config, "params_dtype"):
        summary["params_dtype"] = str(config.params_dtype).removeprefix("torch.")
    return summary


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers: the wrappers would add ``module.`` to every key,
    and a checkpoint must not depend on how the model was wrapped when it was saved."""
    from model_providers.hf_checkpoint import unwrap

    return unwrap(model)


def _part_sharded_state(model, optimizer, scheduler, prefix: str, is_loading: bool, optimizer_format: str) -> dict:
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

    model_state = _unwrapped(model).sharded_state_dict()
    if prefix:
        add_prefix_for_sharding(model_state, prefix)
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                          metadata=sharding_metadata(optimizer_format))
        if prefix and optimizer_format == "dp_reshardable":  # its keys name gradient buffers, not the (prefixed)
            add_prefix_for_sharding(state["optimizer"], prefix)  # parameters: a companion's would be the model's
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    return state


def _part_marker(model, optimizer, scheduler, fresh: bool, optimizer_format: str) -> dict:
    return {"model": _model_summary(model), "scheduler": scheduler is not None,
            "optimizer": None if optimizer is None else {"kind": optimizer_kind(optimizer), "fresh": fresh,
                                                         "format": optimizer_format}}


def save_checkpoint(directory: str | os.PathLike, model: torch.nn.Module, extra_state: dict | None = None, *,
                    metadata: dict | None = None, files: Mapping[str, str | os.PathLike] | None = None,
                    overwrite: bool = False, training: TrainingState | None = None,
                    writer: AsyncCheckpointWriter | None = None) -> Path:
    """Saves this rank's shards of ``model`` as a distributed checkpoint at ``directory``, atomically.

    Collective: every rank of the job calls it with its own model stage/shard. ``model`` is anything with
    Megatron's ``sharded_state_dict()`` (a GPTModel, or Megatron DDP around one). ``metadata`` must be
    JSON-serialisable and lands in the marker file; ``extra_state`` see the module docstring. ``files`` maps
    relative paths inside the checkpoint to files that rank 0 copies in before publishing. An existing
    checkpoint at ``directory`` is an error unless ``overwrite``. ``training``: what resuming a run needs
    besides the weights. With ``writer`` the tensors are written in the background and the checkpoint
    appears at the returned path only when ``writer`` publishes it (:mod:`megarlhf.checkpoint.async_save`);
    ``model`` may change as soon as this returns. Returns the final path.
    """
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    torch_strategy.logger.addFilter(_SYNC_SAVE_NOTICE_FILTER)  # once: a Filterer keeps one of each
    _require_distributed("save_checkpoint")
    final, training = Path(directory).absolute(), training or TrainingState()
    _check_save(final, metadata, files, overwrite, training)
    token = publish.shared_token()
    tmp = final.with_name(f"{final.name}.tmp-{token}")
    if publish.rank() == 0:
        _remove_leftovers(final)
        tmp.mkdir(parents=True)
    publish.barrier()
    parts = {"": Companion(model, training.optimizer, training.scheduler), **training.companions}
    fresh = {name: part.optimizer is not None and is_fresh(part.optimizer) for name, part in parts.items()}
    markers = {name: _part_marker(part.model, part.optimizer, part.scheduler, fresh[name], training.optimizer_format)
               for name, part in parts.items()}
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        request = _write_state(tmp, parts, fresh, extra_state, writer, training.optimizer_format)
    except (OSError, CheckpointException) as err:  # torch's write failures derive from BaseException; a bug
        raise _write_failure(final, tmp, err) from err  # elsewhere stays an internal error with its traceback
    _write_side_files(tmp, files, training.rank_state)
    main = markers.pop("")
    marker = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "megarlhf_version": megarlhf_version,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "saved_with": current_layout(), "model": main["model"], "optimizer": main["optimizer"],
        "scheduler": main["scheduler"], "companions": markers, "rank_state": training.rank_state is not None,
        "has_extra_state": extra_state is not None, "metadata": metadata or {},
    }
    if writer is None:
        _publish_checkpoint(tmp, final, token, marker)
    else:
        writer.schedule(request, final, lambda: _publish_checkpoint(tmp, final, token, marker))
    return final


def _write_failure(final: Path, tmp: Path, err: BaseException) -> CheckpointError:
    """The one-line error of a save whose tensor files could not be written (a full disk, most often: Megatron's
    writer reports its worker's failure by class alone, so the free space is given beside it)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    cause = f"{type(err).__name__}: {lines[-1] if lines else ''}"[:300]
    try:
        free = f"{shutil.disk_usage(tmp.parent).free / 2**30:.2f} GiB free on its file system"
    except OSError:
        free = "the free space of its file system unknown"
    return CheckpointError(f"writing checkpoint {final} failed ({cause}); {free}; the previous checkpoints are "
                           f"unchanged; the partial save {tmp.name} beside it may be deleted (the next save "
                           f"removes it)")


def _check_save(final: Path, metadata, files, overwrite: bool, training: TrainingState) -> None:
    """What a save refuses before writing anything, each naming the problem."""
    try:
        json.dumps(metadata)
    except TypeError as err:
        raise CheckpointError(f"checkpoint metadata for {final} is not JSON-serialisable: {err}") from None
    check_replaceable(final, overwrite, "checkpoint directory")
    missing = [str(source) for source in (files or {}).values() if not Path(source).is_file()]
    if missing:
        raise CheckpointError(f"files to add to checkpoint {final} do not exist: {missing}")
    bad = [name for name in training.companions if not name.isidentifier()]
    if bad:
        raise CheckpointError(f"companion model names must be identifiers, got {bad}")


@contextlib.contextmanager
def _write_results_in_process():
    """Megatron's file writer hands its write results to the saving rank through a process-wide queue that it
    makes on the first save: a ``multiprocessing.Manager`` queue, i.e. a server process spawned on the save's
    critical path that imports torch to unpickle the results (3-4 s of the first save on CPU, in every process;
    it then lives until exit). A synchronous save writes in this process, so a plain queue serves; the async
    writer (``checkpoint.async_save``) writes from another process and keeps Megatron's queue."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = previous


def _write_state(tmp: Path, parts: dict[str, Companion], fresh: dict[str, bool], extra_state: dict | None,
                 writer: AsyncCheckpointWriter | None, optimizer_format: str):
    """Writes the tensors of every part into ``tmp`` (or, with ``writer``, starts writing them in the
    background and returns Megatron's async request)."""
    from megatron.core import dist_checkpointing

    main, companions = parts[""], {name: part for name, part in parts.items() if name}
    try:
        for name, part in parts.items():
            if fresh[name]:
                prime(part.optimizer)  # a fresh DistributedOptimizer cannot build its state dict (bug 1)
        state = _part_sharded_state(main.model, main.optimizer, main.scheduler, "", False, optimizer_format)
        state["companions"] = {name: _part_sharded_state(part.model, part.optimizer, part.scheduler, f"{name}.",
                                                         False, optimizer_format) for name, part in companions.items()}
        if extra_state is not None:
            state["extra_state"] = extra_state
        if writer is None:
            with _write_results_in_process():
                return dist_checkpointing.save(state, str(tmp))
        return dist_checkpointing.save(state, str(tmp), async_sharded_save=True, async_strategy=writer.strategy)
    finally:
        for name, part in parts.items():
            if fresh[name]:
                clear_state(part.optimizer)


def _write_side_files(tmp: Path, files: Mapping[str, str | os.PathLike] | None, rank_state: Any) -> None:
    """This rank's ``rank_state``, and (rank 0) the side files as they are when the save is made."""
    if rank_state is not None:
        (tmp / RANK_STATE_DIR).mkdir(exist_ok=True)
        torch.save(rank_state, tmp / RANK_STATE_DIR / f"rank{publish.rank()}.pt")
    if publish.rank() == 0:
        for relative, source in (files or {}).items():
            (tmp / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, tmp / relative)


def _publish_checkpoint(tmp: Path, final: Path, token: str, marker: dict) -> None:
    """After every rank's tensors are written: rank 0 writes the marker, then renames. A failure there is
    raised on every rank (the others would otherwise wait at a barrier until rank 0's process is gone)."""
    publish.barrier()
    failure = None
    if publish.rank() == 0:
        try:
            publish.write_json_durably(tmp / MARKER_FILE, marker)
            publish.publish_directory(tmp, final, token)
        except Exception as err:
            failure = err
    message = publish.from_rank0(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    if message is not None:
        raise CheckpointError(f"rank 0 could not publish checkpoint {final} ({message}); it was not published")


def _missing_message(path: Path) -> str:
    message = f"no checkpoint at {path}: the directory does not exist"
    moved = [p for p in publish.siblings(path, "old") if is_complete_checkpoint(p)]
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


def _saved_format(marker: dict) -> str:
    """The DistributedOptimizer format a part was saved in (checkpoints before the choice: the one then)."""
    return (marker.get("optimizer") or {}).get("format", SAVED_BEFORE_FORMATS)


def _apply_part(loaded: dict, part: Companion, marker: dict, strict: bool) -> None:
    _unwrapped(part.model).load_state_dict(loaded["model"], strict=strict)
    if part.optimizer is not None:
        load_optimizer(part.optimizer, loaded["optimizer"])
        if (marker.get("optimizer") or {}).get("fresh"):
            clear_state(part.optimizer)  # saved before its first step: the next step is a first step again
    if part.scheduler is not None:
        part.scheduler.load_state_dict(loaded["scheduler"])


def load_checkpoint(directory: str | os.PathLike, model: torch.nn.Module, *, strict: bool = True,
                    training: TrainingState | None = None) -> dict | None:
    """Loads the checkpoint at ``directory`` into ``model`` (this rank's shards, any TP/PP layout).

    Collective. Returns the ``extra_state`` it was saved with (None if none). Every parameter the model
    expects must be in the checkpoint; with ``strict`` the model must also accept every loaded entry.
    ``training``'s optimizer, scheduler and companions (as saved by :func:`save_checkpoint`) are loaded in
    place too; they must all be in the checkpoint, and a checkpoint with companions needs them all (its
    ``rank_state`` is read by :func:`load_rank_state`).
    """
    training = training or TrainingState()
    optimizer, scheduler = training.optimizer, training.scheduler
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import StrictHandling

    _require_distributed("load_checkpoint")
    path = Path(directory).absolute()
    info = checkpoint_metadata(path)
    _check_model_matches(info, model, path)
    companions = dict(training.companions)
    if optimizer is not None or scheduler is not None or companions:
        check_parts_match(info, path, optimizer, scheduler, companions)
    for name, part in companions.items():
        _check_model_matches(info["companions"][name], part.model, path)
    parts = {"": Companion(model, optimizer, scheduler), **companions}
    for part in parts.values():
        if part.optimizer is not None:
            prime(part.optimizer)  # a fresh DistributedOptimizer cannot build its loading state dict (bug 1)
    request = _part_sharded_state(model, optimizer, scheduler, "", True, _saved_format(info))
    if companions:
        request["companions"] = {name: _part_sharded_state(part.model, part.optimizer, part.scheduler, f"{name}.",
                                                           True, _saved_format(info["companions"][name]))
                                 for name, part in companions.items()}
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
    file = path / RANK_STATE_DIR / f"rank{publish.rank()}.pt"
    if not file.is_file():
        raise CheckpointError(f"incomplete checkpoint at {path}: {file.name} is missing from {RANK_STATE_DIR}/")
    return torch.load(file, weights_only=True)
