"""What a failed command prints: one line per distinct error, once per launch, and where the traceback went.

Every rank of a job meets the same bad input and would print the same line; under a launcher (torchrun,
``megarlhf ... --nproc-per-node``, srun) the first rank to report a message claims it with a marker file
named after the launching process (its pid and start time), and the others stay quiet. An error inside
megarlhf (not the user's input) prints one line too; its traceback goes to the run's log directory
(``<run_dir>/logs``, once a run has one; the temp directory before that) unless ``--verbose`` asks for it
on the terminal.
"""
from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

_log_dir: Path | None = None
_log_dir_listeners: list = []


def on_log_dir(listener) -> None:
    """Calls ``listener(path)`` when the run's log directory is set (at once if it is already)."""
    _log_dir_listeners.append(listener)
    if _log_dir is not None:
        listener(_log_dir)


def set_log_dir(path: Path) -> None:
    """Where the run keeps its logs (this rank's log, tracebacks of internal errors)."""
    global _log_dir
    _log_dir = Path(path)
    for listener in _log_dir_listeners:
        listener(_log_dir)


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _launcher_key() -> str | None:
    """The launching process (pid and start time: a pid is reused, the pair is not); None without one."""
    if int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))) <= 1:
        return None
    parent = os.getppid()
    try:
        started = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"{parent}-{started}"


def first_to_report(message: str) -> bool:
    """True for the first rank of this launch to report ``message`` (always True outside a launcher, or when
    the marker cannot be written)."""
    key = _launcher_key()
    if key is None:
        return True
    directory = Path(tempfile.gettempdir()) / f"megarlhf-errors-{os.getuid()}"
    digest = hashlib.sha256(message.encode("utf-8", "replace")).hexdigest()[:16]
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        if directory.is_symlink() or directory.stat().st_uid != os.getuid():
            return True  # not ours: print rather than trust it
    except OSError:  # a file in the way, no temp directory: print
        return True
    try:
        os.close(os.open(directory / f"{key}-{digest}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True
    _forget_old_markers(directory)
    return True


def _forget_old_markers(directory: Path, max_age_s: float = 86400.0) -> None:
    """Markers of launches that ended long ago (only a running launch's markers matter)."""
    now = time.time()
    for marker in directory.iterdir():
        try:
            if now - marker.stat().st_mtime > max_age_s:
                marker.unlink()
        except OSError:
            pass


def report_error(command: str, message: str, where: str = "") -> None:
    """``megarlhf COMMAND: error: MESSAGE (WHERE)`` on stderr on one line, once per launch for a message."""
    line = f"megarlhf {command}: error: {' '.join(message.split())}"
    if first_to_report(line):
        print(f"{line} ({where})" if where else line, file=sys.stderr, flush=True)


MAX_SUMMARY = 1500  # characters of an internal error's message on its line (all of it in the traceback file)


def report_internal_error(command: str, err: BaseException) -> None:
    """One line for an error inside megarlhf, naming the file that holds this rank's traceback."""
    directory = _log_dir or Path(tempfile.gettempdir())
    path = directory / f"traceback-{command}-rank{_rank()}-{os.getpid()}.txt"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with os.fdopen(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600), "w") as f:  # may hold paths, values
            f.write("".join(traceback.format_exception(err)))
        where = f"an error inside megarlhf: traceback in {path}, or run with --verbose"
    except OSError:
        where = "an error inside megarlhf: run with --verbose for the traceback"
    summary = str(err)  # every line of the message (a verdict lists its problems below its first line)
    if len(summary) > MAX_SUMMARY:
        summary = summary[:MAX_SUMMARY] + " ..."
    report_error(command, f"{type(err).__name__}: {summary}", where)
