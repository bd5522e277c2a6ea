"""Directories and files megarlhf writes for a user: which existing directories it may replace, and the
modes of what it writes.

An output directory megarlhf wrote (an HF export, a PEFT adapter, a converted checkpoint, a fetched model)
holds one of :data:`OWNER_FILES`. A non-empty directory without one is the user's: no command replaces it,
``--overwrite`` or not, and never the current working directory or one holding it. An empty directory
is as good as none.

Modes: safetensors and :func:`tempfile.mkstemp` create files 0600 whatever the umask; what megarlhf hands
to the user (exports, ``config.yaml``) gets the modes the user's umask gives a new file instead
(:func:`apply_umask`), so a colleague in the group can read a shared run as with any other file.
"""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

from megarlhf.core.errors import CheckpointError

OUTPUT_MARKER = "megarlhf-output.json"  # written last into an export or adapter directory
# A directory holding any of these was written by megarlhf: an export, a fetched model, a distributed checkpoint.
OWNER_FILES = (OUTPUT_MARKER, "megarlhf-fetch.json", "megarlhf_checkpoint.json")


def written_by_megarlhf(directory: Path) -> bool:
    return any((directory / name).is_file() for name in OWNER_FILES)


def check_replaceable(out: Path, overwrite: bool, what: str = "output") -> None:
    """Refuses ``out`` when it is a file, or a non-empty directory unless ``overwrite`` and megarlhf wrote it
    (and it does not hold the current working directory). ``what`` names ``out`` in the messages."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{what} {out} exists and is not a directory")
    if not (out.is_dir() and any(out.iterdir())):
        return
    if not written_by_megarlhf(out):
        raise CheckpointError(f"{what} {out} is not empty and was not written by megarlhf (it holds none of "
                              f"{', '.join(OWNER_FILES)}): megarlhf replaces only its own directories; move it "
                              "away or choose another directory")
    if not overwrite:
        raise CheckpointError(f"{what} {out} already exists; pass --overwrite (overwrite=True) to replace it")
    cwd = Path.cwd().resolve()
    if cwd == out.resolve() or out.resolve() in cwd.parents:
        raise CheckpointError(f"{what} {out} holds the current working directory ({cwd}); refusing to replace it")


def write_output_marker(directory: Path, kind: str, **details) -> None:
    """Marks ``directory`` as megarlhf's ``kind`` of output (``details``: JSON values, e.g. the source)."""
    from megarlhf import __version__

    record = {"kind": kind, "megarlhf_version": __version__,
              "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **details}
    (Path(directory) / OUTPUT_MARKER).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def current_umask() -> int:
    """The process umask, read without changing it (Linux reports it in /proc; elsewhere set and restored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: Path) -> None:
    """Gives ``path`` (a file, or a directory and everything under it) the modes a new file or directory gets
    under the current umask."""
    path, mask = Path(path), current_umask()
    if path.is_file():
        os.chmod(path, 0o666 & ~mask)
        return
    os.chmod(path, 0o777 & ~mask)
    for root, dirs, files in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)
