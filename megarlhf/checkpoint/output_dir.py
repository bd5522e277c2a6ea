"""Output directories that ``megarlhf fetch`` writes whole or not at all, and replaces only when it owns them.

:func:`atomic_output_dir` builds the directory beside its destination (``.NAME.partial-PID-HEX``) and
renames it into place when the build succeeded; an error deletes the build. A crash (a SIGKILL, a power
cut) cannot run that clean-up, so each call first sweeps the partial and set-aside (``.NAME.old-PID-HEX``)
siblings of the same destination left by processes that no longer run.

Ownership: a directory fetch wrote holds :data:`MARKER_FILE` (written last, inside the build). With
``overwrite`` a non-empty destination is replaced only if it holds that file, so ``--overwrite`` cannot
delete a directory of the user's (``--out .``, a home directory, a checkpoint); and never the current
working directory or one that contains it.
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Iterator

from megarlhf.core.errors import CheckpointError

MARKER_FILE = "megarlhf-fetch.json"  # what fetch wrote there (the last file of a complete directory)


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Refuses a non-directory ``out``, a non-empty one unless ``overwrite``, and with ``overwrite`` one that
    fetch did not write or that holds the current working directory."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"output {out} exists and is not a directory")
    if not (out.is_dir() and any(out.iterdir())):
        return
    if not overwrite:
        raise CheckpointError(f"output {out} already exists and is not empty; pass --overwrite "
                              "(overwrite=True) to replace a directory megarlhf fetch wrote")
    if not (out / MARKER_FILE).is_file():
        raise CheckpointError(f"output {out} is not empty and was not written by megarlhf fetch (it has no "
                              f"{MARKER_FILE}): --overwrite replaces only fetch's own directories; remove it "
                              "yourself or choose another output directory")
    cwd = Path.cwd().resolve()
    if cwd == out.resolve() or out.resolve() in cwd.parents:
        raise CheckpointError(f"output {out} holds the current working directory ({cwd}); refusing to replace it")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_leftovers(out: Path) -> list[Path]:
    """Deletes the partial builds and set-aside copies of ``out`` whose writing process is gone; returns them."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(?:partial|old)-(\d+)-[0-9a-f]+$")
    swept = []
    if not out.parent.is_dir():
        return swept
    for entry in out.parent.iterdir():
        match = pattern.match(entry.name)
        if match and entry.is_dir() and not _pid_alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            swept.append(entry)
    return swept


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yields an empty temporary sibling of ``out_dir``; on success it is renamed to ``out_dir`` (an old
    ``out_dir`` is replaced only as :func:`check_output_dir` allows), on an error it is deleted."""
    out = Path(out_dir).absolute()
    check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_leftovers(out)
    build = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    build.mkdir()
    try:
        yield build
        if not (build / MARKER_FILE).is_file():
            raise CheckpointError(f"internal error: the build of {out} has no {MARKER_FILE}")
        check_output_dir(out, overwrite)  # something may have appeared there meanwhile
        old = None
        if out.exists() and any(out.iterdir()):
            old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(out, old)
        os.rename(build, out)  # replaces an empty directory
        if old is not None:
            shutil.rmtree(old)
    finally:
        if build.exists():
            shutil.rmtree(build, ignore_errors=True)
