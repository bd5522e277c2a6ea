"""Atomic Megatron distributed checkpoints of a model, loadable at any tensor/pipeline-parallel layout.

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
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

MARKER_FILE = "megarlhf_checkpoint.json"
FORMAT = "megarlhf.dist_checkpoint"
FORMAT_VERSION = 1
# TransformerConfig fields that decide tensor shapes: a mismatch is reported before Megatron's own error.
_SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "gated_linear_unit", "add_qkv_bias", "qk_layernorm")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, incompatible with the model, or cannot be written."""


def _require_distributed(action: str) -> None:
    if not dist.is_initialized():
        raise CheckpointError(f"{action} needs torch.distributed and Megatron's parallel state: call "
                              "parallel.runtime.init_parallel(...) first (it works in a single process too)")


def _rank() -> int:
    return dist.get_rank()


def _barrier() -> None:
    if dist.get_world_size() > 1:
        dist.barrier()


def _shared_token() -> str:
    """A name suffix chosen by rank 0 and known to every rank."""
    token = [f"{os.getpid()}-{uuid.uuid4().hex[:8]}" if _rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(token, src=0)
    return token[0]


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
                      data_parallel_size=ps.get_data_parallel_world_size())
    return layout


def save_checkpoint(directory: str | os.PathLike, model: torch.nn.Module, extra_state: dict | None = None, *,
                    metadata: dict | None = None, files: Mapping[str, str | os.PathLike] | None = None,
                    overwrite: bool = False) -> Path:
    """Saves this rank's shards of ``model`` as a distributed checkpoint at ``directory``, atomically.

    Collective: every rank of the job calls it with its own model stage/shard. ``model`` is anything with
    Megatron's ``sharded_state_dict()`` (a GPTModel, or Megatron DDP around one). ``metadata`` must be
    JSON-serialisable and lands in the marker file; ``extra_state`` see the module docstring. ``files`` maps
    relative paths inside the checkpoint to files that rank 0 copies in before publishing. An existing
    checkpoint at ``directory`` is an error unless ``overwrite``. Returns the final path.
    """
    from megatron.core import dist_checkpointing

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
    token = _shared_token()
    tmp = final.with_name(f"{final.name}.tmp-{token}")
    if _rank() == 0:
        _remove_leftovers(final)
        tmp.mkdir(parents=True)
    _barrier()
    state: dict[str, Any] = {"model": model.sharded_state_dict()}
    if extra_state is not None:
        state["extra_state"] = extra_state
    dist_checkpointing.save(state, str(tmp))
    _barrier()
    if _rank() == 0:
        from megarlhf import __version__

        marker = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "megarlhf_version": __version__,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "saved_with": _layout(), "model": _model_summary(model),
            "has_extra_state": extra_state is not None, "metadata": metadata or {},
        }
        for relative, source in (files or {}).items():
            (tmp / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, tmp / relative)
        _write_json_durably(tmp / MARKER_FILE, marker)
        _publish(tmp, final, token)
    _barrier()
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


def load_checkpoint(directory: str | os.PathLike, model: torch.nn.Module, *, strict: bool = True) -> dict | None:
    """Loads the checkpoint at ``directory`` into ``model`` (this rank's shards, any TP/PP layout).

    Collective. Returns the ``extra_state`` it was saved with (None if none). Every parameter the model
    expects must be in the checkpoint; with ``strict`` the model must also accept every loaded entry.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import StrictHandling

    _require_distributed("load_checkpoint")
    path = Path(directory).absolute()
    info = checkpoint_metadata(path)
    _check_model_matches(info, model, path)
    try:
        # RAISE_UNEXPECTED: a model tensor absent from the checkpoint is an error; checkpoint entries the
        # model does not ask for (e.g. optimizer state) are fine.
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(path),
                                         strict=StrictHandling.RAISE_UNEXPECTED)
    except CheckpointingException as err:
        raise CheckpointError(f"cannot load checkpoint at {path} into this model: {err}") from err
    model.load_state_dict(loaded["model"], strict=strict)
    return loaded.get("extra_state") if info.get("has_extra_state") else None
