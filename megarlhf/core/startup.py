"""Where a run's start-up seconds go: named phases from the process's start to its first step.

Each rank keeps one timeline (this module's state). ``mark(name)`` closes the phase that began at the
previous mark (the first one at the process's creation, so the interpreter's start and the imports
count); the run reports the phases with its first step's metrics as ``time/startup/<phase>_s`` and
``time/startup_s`` (their sum), and the rank's log gets one line. A mark made after the report (a later
step) is ignored. :func:`begin` starts a run's timeline: a second run in the same process counts from
its own start.
"""
from __future__ import annotations

import logging
import os
import time

_marks: list[tuple[str, float]] = []
_reported = False
_origin: float | None = None  # None: no run began yet (phases count from the process's creation)


def process_start() -> float:
    """This process's creation time (seconds since the epoch); now when it cannot be read."""
    try:
        import psutil

        return psutil.Process(os.getpid()).create_time()
    except Exception:  # noqa: BLE001 - an unreadable /proc only loses the imports' phase
        return time.time()


def begin() -> None:
    """Starts a run's timeline: from the process's creation for its first run, from now for a later one."""
    global _origin, _reported
    _origin = process_start() if _origin is None else time.time()
    _marks.clear()
    _reported = False


def mark(name: str) -> None:
    """Ends the start-up phase ``name`` now (it began at the previous mark, or at the process's start)."""
    if not _reported:
        _marks.append((name, time.time()))


def phases() -> dict[str, float]:
    """Seconds per phase, in the order marked (a name marked twice adds up)."""
    seconds: dict[str, float] = {}
    previous = process_start() if _origin is None else _origin
    for name, at in _marks:
        seconds[name] = seconds.get(name, 0.0) + max(at - previous, 0.0)
        previous = at
    return seconds


def report() -> dict[str, float]:
    """The phases as metrics (``time/startup/<phase>_s`` and their sum ``time/startup_s``), once: later
    calls return {} and later marks are ignored."""
    global _reported
    if _reported or not _marks:
        _reported = True
        return {}
    _reported = True
    seconds = phases()
    metrics = {"time/startup_s": sum(seconds.values()), **{f"time/startup/{k}_s": v for k, v in seconds.items()}}
    logging.getLogger(__name__).info(describe(metrics))
    return metrics


def describe(metrics: dict[str, float]) -> str:
    """One line for the run's log: the total and each phase, from :func:`report`'s metrics."""
    parts = [f"{key.removeprefix('time/startup/').removesuffix('_s')} {value:.1f}"
             for key, value in metrics.items() if key.startswith("time/startup/")]
    return f"start-up {metrics['time/startup_s']:.1f} s: " + ", ".join(parts)
