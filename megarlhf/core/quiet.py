"""Quiet commands: the terminal shows megarlhf's own lines; what the libraries log goes to the run's log.

Without ``--verbose``, :func:`quiet_environment` (set before torch is imported, inherited by the ranks a
launcher starts) turns off the libraries' own console set-up: vLLM's logging handler, transformers'
INFO, Hugging Face progress bars, torch's C++ warnings. :func:`route_logs` then gives the root logger
one handler writing every INFO+ record to ``<run_dir>/logs/rank<N>.log`` (held in memory until
:func:`megarlhf.core.console.set_log_dir` names the directory), and shows on the terminal, once per
launch, the warnings of megarlhf's own packages. Python warnings raised by megarlhf's code show as one
line each; those of the libraries (deprecations inside vLLM, torch, Megatron) go to the log.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

from megarlhf.core import console

QUIET_ENVIRONMENT = {
    "VLLM_CONFIGURE_LOGGING": "0",  # vLLM's loggers then reach the root handler below
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10 warnings (NUMA binding notices) print straight to stderr
    "TOKENIZERS_PARALLELISM": "false",
}
OWN_PACKAGES = ("megarlhf", "parallel", "model_providers")
_OWN_DIRS = tuple(str(Path(__file__).resolve().parents[2] / name) + os.sep for name in OWN_PACKAGES)
MAX_BUFFERED = 20000


def quiet_environment() -> None:
    """The variables above, where the user has not set them."""
    for key, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(key, value)


def _is_own_logger(name: str) -> bool:
    return name.split(".")[0] in OWN_PACKAGES


class RunLog(logging.Handler):
    """Every record to ``<directory>/rank<N>.log``; until the directory is known, kept in memory. Warnings
    of megarlhf's own loggers also go to stderr, once per launch."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.pending: list[logging.LogRecord] = []
        self.file = None

    def open(self, directory: Path) -> None:
        if self.file is not None:
            self.file.close()
        directory.mkdir(parents=True, exist_ok=True)
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
        self.file = open(directory / f"rank{rank}.log", "a", encoding="utf-8")
        for record in self.pending:
            self._write(record)
        self.pending = []

    def _write(self, record: logging.LogRecord) -> None:
        self.file.write(self.format(record) + "\n")
        self.file.flush()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if record.levelno >= logging.WARNING and _is_own_logger(record.name):
                message = record.getMessage()
                if console.first_to_report(f"warning: {message}"):
                    print(f"megarlhf: warning: {' '.join(message.split())}", file=sys.stderr, flush=True)
            if self.file is not None:
                self._write(record)
            elif len(self.pending) < MAX_BUFFERED:
                self.pending.append(record)
        except Exception:  # noqa: BLE001 - logging must never stop the run
            self.handleError(record)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """megarlhf's own warnings: one line on stderr; the libraries': the log."""
    if str(Path(filename).resolve()).startswith(_OWN_DIRS):
        text = f"megarlhf: warning: {' '.join(str(message).split())}"
        if console.first_to_report(text):
            print(text, file=sys.stderr, flush=True)
        return
    logging.getLogger("py.warnings").info(warnings.formatwarning(message, category, filename, lineno, line).strip())


def route_logs() -> RunLog:
    """Installs the handler and the warnings hook (see the module docstring); returns the handler."""
    handler = RunLog()
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    warnings.showwarning = _show_warning
    console.on_log_dir(handler.open)
    return handler
