"""Publishing a checkpoint directory atomically across ranks: every rank writes into ``<dir>.tmp-<token>``,
rank 0 renames it to its final name once a durable completion marker is in (an overwritten checkpoint is
moved aside to ``<dir>.old-<token>`` first and deleted after). A crash before the rename leaves the
previous checkpoint untouched and nothing under the final name."""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist


def rank() -> int:
    return dist.get_rank()


def barrier() -> None:
    if dist.get_world_size() > 1:
        dist.barrier()


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (collective; also a barrier)."""
    box = [value if rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def shared_token() -> str:
    """A name suffix chosen by rank 0 and known to every rank."""
    return from_rank0(f"{os.getpid()}-{uuid.uuid4().hex[:8]}" if rank() == 0 else None)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path.parent)


def siblings(final: Path, kind: str) -> list[Path]:
    """Directories named ``<final>.<kind>-*`` next to ``final`` (kind: "tmp" or "old")."""
    if not final.parent.is_dir():
        return []
    prefix = f"{final.name}.{kind}-"
    return sorted(p for p in final.parent.iterdir() if p.name.startswith(prefix) and p.is_dir())


def publish_directory(tmp: Path, final: Path, token: str) -> None:
    """Gives the finished ``tmp`` directory its final name (rank 0 only)."""
    if final.exists():
        aside = final.with_name(f"{final.name}.old-{token}")
        os.rename(final, aside)
        os.rename(tmp, final)
        fsync_dir(final.parent)
        shutil.rmtree(aside)
    else:
        os.rename(tmp, final)
        fsync_dir(final.parent)
