"""A pool of worker processes that runs user calls (reward functions) with limits the parent enforces.

:class:`TimedProcessPool` has the interface of :class:`megarlhf.isolation.timed_calls.TimedThreadPool`
(``run(calls, timeout_s) -> timed_out``), for calls a thread cannot bound: a call that holds the GIL
(a catastrophic regex, big-integer or symbolic work) or never returns. Each worker is a child
interpreter (``python -m megarlhf.isolation.process_pool RESOLVER ...``) that resolves the pool's function names
(``resolver(name)`` gives the function, e.g. :func:`megarlhf.rewards.api.resolve_reward`) and imports
what they declare they need (``megarlhf_preload``) before it reports ready, then calls
``fn(item, **kwargs)`` for each call (``fn``: one of the names). Limits:

* **wall clock**, from the moment the call is sent to a ready worker: past ``timeout_s`` the parent kills the worker
  and its process group (SIGKILL: a subprocess the function started dies with it) and starts a replacement;
  nothing is abandoned, so nothing leaks;
* **CPU time** per call, as many seconds as the wall clock allows (``RLIMIT_CPU`` moved forward before
  each call; SIGXCPU ends a worker that spins past it) and **address space** per worker
  (``RLIMIT_AS``): a worker that dies (a limit, a segfault, ``os._exit``) is replaced and its call
  reported as an error.

Requests travel pickled (parent to worker: trusted data it made); replies are JSON (a number, numpy's
included, or an error's type and message), so a compromised worker cannot send the parent a pickle to run.
Both travel on descriptors private to the worker: its stdin and stdout are /dev/null and stderr, so what a
function or its subprocesses print or read cannot corrupt a reply or steal a request. ``killed``
counts the workers killed or found dead since the pool started. Costs: a worker start is a fresh
interpreter (~0.4 s, once per worker and per kill); a call pays two pipe round trips and the pickling
of its item (``bench/bench_reward_pool.py``).
"""
from __future__ import annotations

import importlib
import json
import math
import numbers
import os
import pickle
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from queue import SimpleQueue
from typing import Any, Sequence

from megarlhf.isolation.timed_calls import TimedCall

_HEADER = struct.Struct("!I")
_MAX_REPLY = 2**20
STARTUP_S = 120.0  # a worker's start-up (interpreter, imports), not counted against any call


class WorkerError(RuntimeError):
    """A call that raised in its worker, died with it, or returned what a reply cannot carry."""


def _write_frame(stream, payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def _read_exactly(fd: int, size: int, deadline: float) -> bytes | None:
    """``size`` bytes from ``fd`` before ``deadline`` (monotonic); None on timeout or end of file. (poll, not
    select: a trainer holds many files, and select refuses descriptors past 1023.)"""
    data, poller = b"", select.poll()
    poller.register(fd, select.POLLIN)
    while len(data) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not poller.poll(remaining * 1000):
            return None
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _read_frame(fd: int, deadline: float) -> bytes | str | None:
    """One reply from ``fd`` before ``deadline``: its bytes, None on timeout or end of file, or why it is
    refused (a text) when it is larger than _MAX_REPLY."""
    header = _read_exactly(fd, _HEADER.size, deadline)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > _MAX_REPLY:
        return f"the worker's reply has {size} bytes (at most {_MAX_REPLY})"
    return _read_exactly(fd, size, deadline)


class _Worker:
    """One child process and its pipes. It resolves every name and imports what the functions declare they
    need (``megarlhf_preload``) before it reports ready, so that no call's clock pays for imports."""

    def __init__(self, resolver: str, names: list[str], memory_mb: int):
        # the worker imports what this process can: user functions named by dotted path resolve alike
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen([sys.executable, "-m", "megarlhf.isolation.process_pool", resolver, str(memory_mb),
                                         json.dumps(names)], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
        self.ready = False

    def wait_ready(self) -> str | None:
        """None once the worker is ready, else why it is not."""
        body = _read_frame(self.process.stdout.fileno(), time.monotonic() + STARTUP_S)
        try:
            late = f"no answer within {STARTUP_S:g} s"
            reply = json.loads(body) if isinstance(body, bytes) else {"error": body or late}
        except ValueError:
            reply = {"error": "an unreadable start-up reply"}
        if reply.get("error"):
            return f"the worker process could not start: {str(reply['error'])[:500]}"
        self.ready = True
        return None

    def call(self, call: TimedCall, cpu_s: int, timeout_s: float) -> str:
        """Runs ``call`` in this worker; sets its value or error; returns "ok", "timeout" or "dead"."""
        if not self.ready and (problem := self.wait_ready()) is not None:
            call.error = WorkerError(problem)
            return "dead"
        call.started = time.monotonic()
        deadline = call.started + timeout_s
        try:
            _write_frame(self.process.stdin, pickle.dumps((call.fn, call.item, call.kwargs, cpu_s)))
        except (BrokenPipeError, OSError):
            call.error = WorkerError("the worker process had died before the call")
            return "dead"
        body = _read_frame(self.process.stdout.fileno(), deadline)
        if body is None:
            return "timeout" if time.monotonic() >= deadline else self._died(call, deadline)
        if isinstance(body, str):
            call.error = WorkerError(body)
            return "dead"
        try:
            reply = json.loads(body)
            if "value" in reply:
                call.value = reply["value"]
            else:
                call.error = WorkerError(f"{reply['error_type']}: {reply['message']}")
        except (ValueError, KeyError, TypeError, RecursionError):
            call.error = WorkerError("the worker's reply is not a valid result")
            return "dead"
        return "ok"

    def _died(self, call: TimedCall, deadline: float) -> str:
        """The reply pipe closed before ``deadline``: the worker died, or closed its end and went on (it is
        then given until the deadline to exit, and killed by the pool after)."""
        if not self._exited_by(deadline):
            call.error = WorkerError("the worker process closed its reply pipe during the call")
            return "dead"
        self.kill()  # its process group too, while its unreaped pid still names the group
        code = self.process.returncode
        why = f"signal {-code}" if code < 0 else f"exit code {code}"
        call.error = WorkerError(f"the worker process died during the call ({why}: a CPU or memory limit, a crash "
                                 f"or an exit in the called function)")
        return "dead"

    def _exited_by(self, deadline: float) -> bool:
        """Whether the worker exits before ``deadline``; it is left unreaped (a zombie keeps its pid)."""
        while True:
            try:
                if os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True
            except ChildProcessError:  # reaped already
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def kill(self) -> None:
        if self.process.returncode is None:  # not reaped: its pid (and group id) cannot have been reused
            try:  # its process group: a child the called function started (a subprocess) dies with it
                os.killpg(self.process.pid, signal.SIGKILL)
            except OSError:
                pass
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass


class TimedProcessPool:
    """``num_workers`` worker processes (module docstring); :meth:`run` waits for a list of calls."""

    def __init__(self, num_workers: int, resolver: str, names: list[str], *, memory_mb: int = 4096):
        self.num_workers, self.resolver, self.names, self.memory_mb = num_workers, resolver, list(names), memory_mb
        self.killed = 0
        self._lock = threading.Lock()
        self._idle: SimpleQueue[_Worker] = SimpleQueue()
        self._workers: list[_Worker] = []  # started when a run first needs them

    def check_start(self) -> str | None:
        """Starts a worker now and waits until it is ready: None, or why it could not start (an import, a
        function it cannot resolve, its memory limit), for a caller to refuse before any call fails."""
        if not self._workers:
            self._workers.append(_Worker(self.resolver, self.names, self.memory_mb))
            self._idle.put(self._workers[0])
        worker = self._workers[0]
        return None if worker.ready else worker.wait_ready()

    def run(self, calls: Sequence[TimedCall], timeout_s: float) -> list[bool]:
        """Runs ``calls`` (``fn``: a name for the resolver), each limited to ``timeout_s`` of wall time and
        as much CPU time; returns, per call, whether it timed out (its worker was then killed)."""
        while len(self._workers) < min(self.num_workers, len(calls)):  # started as calls first need them
            worker = _Worker(self.resolver, self.names, self.memory_mb)
            self._workers.append(worker)
            self._idle.put(worker)
        cpu_s = max(1, math.ceil(timeout_s))
        timed_out = [False] * len(calls)
        todo: SimpleQueue[int | None] = SimpleQueue()
        for index in range(len(calls)):
            todo.put(index)

        def drive():
            while (index := todo.get()) is not None:
                worker = self._idle.get()
                call = calls[index]
                try:
                    outcome = worker.call(call, cpu_s, timeout_s)
                except Exception as exc:  # noqa: BLE001 - a worker must go back to the pool whatever happens
                    call.error, outcome = WorkerError(f"talking to the worker failed: {exc!r}"), "dead"
                call.done = True
                timed_out[index] = outcome == "timeout"
                try:
                    if outcome != "ok":
                        worker = self._replace(worker)
                finally:
                    self._idle.put(worker)  # else the next call would wait for it forever

        threads = [threading.Thread(target=drive, daemon=True) for _ in self._workers[:len(calls)]]
        for thread in threads:
            todo.put(None)
            thread.start()
        for thread in threads:
            thread.join()
        return timed_out

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        with self._lock:
            self.killed += 1
            fresh = _Worker(self.resolver, self.names, self.memory_mb)
            self._workers[self._workers.index(worker)] = fresh
        return fresh

    def close(self) -> None:
        for worker in self._workers:
            worker.kill()


# ---- the worker's side ---------------------------------------------------------------------------------
def _start(resolver_path: str, names: list[str]) -> tuple[dict[str, Any], str | None]:
    """The named functions and the modules they declare they need, imported; or why not."""
    try:
        module, _, name = resolver_path.partition(":")
        resolve = getattr(importlib.import_module(module), name)
        functions = {ref: resolve(ref) for ref in names}
        for fn in functions.values():
            for needed in getattr(fn, "megarlhf_preload", ()):
                importlib.import_module(needed)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        return {}, f"{type(exc).__name__}: {exc}"
    return functions, None


def _exit_with_parent(parent: int) -> None:
    """Ends this worker when the process that started it is gone (a call stuck in a sleep would otherwise
    outlive a crashed trainer; a call spinning with the GIL held ends at its CPU limit instead)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _private_channels():
    """The request and reply pipes on descriptors of this process alone (not inherited by the subprocesses a
    called function starts); descriptors 0 and 1, which the function's prints and its subprocesses' output
    use, become /dev/null and stderr, so no output can corrupt a reply or read a request."""
    requests = os.fdopen(os.dup(0), "rb")  # os.dup: not inheritable
    replies = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return requests, replies


def _plain_number(value: Any) -> float | int:
    """A number JSON has no type for (a numpy or other registered ``numbers`` scalar) as an int or float, as
    the in-process runner takes it; anything else cannot be a reply."""
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _serve(resolver_path: str, memory_mb: int, names: list[str]) -> None:
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, resource.RLIM_INFINITY))
    requests, replies = _private_channels()
    functions, problem = _start(resolver_path, names)
    _write_frame(replies, json.dumps({"error": problem}).encode())
    while header := requests.read(_HEADER.size):
        (size,) = _HEADER.unpack(header)
        ref, item, kwargs, cpu_s = pickle.loads(requests.read(size))
        usage = resource.getrusage(resource.RUSAGE_SELF)
        spent = int(usage.ru_utime + usage.ru_stime) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (spent + cpu_s, resource.RLIM_INFINITY))
        try:
            value = functions[ref](item, **kwargs)
            reply = json.dumps({"value": value}, default=_plain_number)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, the worker goes on
            reply = json.dumps({"error_type": type(exc).__name__, "message": str(exc)[:500]})
        _write_frame(replies, reply.encode())


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]))
