"""A thread pool that runs user calls (reward functions, tools) with a per-call time limit.

Why threads, not processes: rewards and tools may be closures or user functions that do not pickle, a
pool starts in microseconds, and the rule-based checkers spend milliseconds per call. A Python thread
cannot be killed, so a timed-out call's thread is *abandoned*: it is a daemon (it never blocks
interpreter exit), a fresh worker replaces it so the pool keeps its size, and it exits by itself if the
call ever returns. ``abandoned`` counts those still stuck. A call's clock starts when a worker picks it
up, so the wall time of one batch is at most about ``ceil(calls / num_workers) * timeout_s``.

Not ``concurrent.futures.ThreadPoolExecutor``: it cannot replace a stuck worker and joins
all its threads at interpreter exit, so one hung call would stall the pool and the process.
"""
from __future__ import annotations

import math
import numbers
import sys
import threading
import time
from queue import SimpleQueue
from typing import Any, Callable, Sequence


def is_finite_number(value: Any) -> bool:
    """Whether a user call's result is a usable number: a real (bools count) whose float is finite. An int
    too large for a float (``10**400``) is not one: ``float()`` would raise OverflowError."""
    if not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for a message, cut to ``limit`` characters; an int past Python's digit limit (whose
    repr raises ValueError) is described instead."""
    try:
        text = repr(value)
    except ValueError:
        return f"an int of more than {sys.get_int_max_str_digits()} digits"
    return text if len(text) <= limit else text[:limit] + "..."


class TimedCall:
    """One call ``fn(item, **kwargs)``; its fields are written under the pool's lock."""

    def __init__(self, fn: Callable, item: Any, kwargs: dict[str, Any]):
        self.fn, self.item, self.kwargs = fn, item, kwargs
        self.started: float | None = None
        self.done = False
        self.abandoned = False
        self.value: Any = None
        self.error: BaseException | None = None


class TimedThreadPool:
    """A fixed number of daemon worker threads; :meth:`run` waits for a list of calls, each limited to
    ``timeout_s`` from the moment a worker starts it (see the module docstring)."""

    def __init__(self, num_workers: int):
        self._queue: SimpleQueue[TimedCall | None] = SimpleQueue()
        self._lock = threading.Condition()
        self._num_workers = num_workers
        self.abandoned = 0  # threads stuck in a timed-out call right now
        self._started = False  # the workers start with the first run: a pool nothing calls holds no threads

    def _start_worker(self) -> None:
        threading.Thread(target=self._work, name="megarlhf-timed-call", daemon=True).start()

    def _work(self) -> None:
        while (call := self._queue.get()) is not None:
            with self._lock:
                call.started = time.monotonic()
                self._lock.notify_all()
            value, error = None, None
            try:
                value = call.fn(call.item, **call.kwargs)
            except BaseException as exc:  # user code: every failure is reported, none kills the worker
                error = exc
            with self._lock:
                call.value, call.error, call.done = value, error, True
                self._lock.notify_all()
                if call.abandoned:  # a replacement worker took this thread's place
                    self.abandoned -= 1
                    return

    def run(self, calls: Sequence[TimedCall], timeout_s: float) -> list[bool]:
        """Runs ``calls``; returns, per call, whether it timed out (its thread is then abandoned)."""
        if calls and not self._started:
            self._started = True
            for _ in range(self._num_workers):
                self._start_worker()
        for call in calls:
            self._queue.put(call)
        timed_out = [False] * len(calls)
        pending = list(range(len(calls)))
        with self._lock:
            while pending:
                now, next_deadline, still = time.monotonic(), math.inf, []
                for i in pending:
                    call = calls[i]
                    if call.done:
                        continue
                    if call.started is not None and now >= call.started + timeout_s:
                        call.abandoned, timed_out[i] = True, True
                        self.abandoned += 1
                        self._start_worker()
                        continue
                    if call.started is not None:
                        next_deadline = min(next_deadline, call.started + timeout_s)
                    still.append(i)
                pending = still
                if pending:
                    # workers notify when a call starts or ends, so waiting without a limit is safe
                    self._lock.wait(None if next_deadline == math.inf else next_deadline - now)
        return timed_out

    def close(self) -> None:
        for _ in range(self._num_workers if self._started else 0):
            self._queue.put(None)
