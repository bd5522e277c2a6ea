"""Ending a megarlhf process once its command has returned, without the interpreter's teardown.

A rank of a run holds torch, Megatron, vLLM and transformers; after the command returned, the interpreter's
own finalization (clearing every module's globals, collecting the heap object by object) took 2.3 s of a
SmolLM2 run's 9.1 s shut-down, and does nothing the run needs: its files are written and closed, its
trackers and engines closed. :func:`exit_process` does what an exit must do and then ends the process:

1. every handler registered to run at exit (``atexit``: weakref finalizers such as vLLM's engine shutdown
   and temporary directories, multiprocessing's children and managers, logging's final flush), as a normal
   exit runs them;
2. stdout and stderr flushed;
3. ``os._exit(code)``.

While another non-daemon thread is alive the interpreter would wait for it: then the exit is a normal one.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading


def exit_process(code: int) -> None:
    """Ends the process with exit status ``code`` (module docstring). Does not return."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if others:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can reach it
            pass
    os._exit(code)
