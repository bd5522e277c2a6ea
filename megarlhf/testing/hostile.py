"""Misbehaving user code for the tests of the worker pools (rewards and tools), and the process checks
they make afterwards: one definition of each hostile act, shared by every runner's tests."""
from __future__ import annotations

import ctypes
import os
import re
import time

import psutil


def misbehave(what: str) -> int | None:
    """Does what ``what`` names, in the calling process; returns None for anything else. ``memory``
    returns a length only where 8 GiB can be allocated (a worker's address-space limit refuses it)."""
    if what == "regex":  # catastrophic backtracking: holds the GIL in C for ages
        re.match(r"(a+)+$", "a" * 64 + "b")
    elif what == "hang":
        time.sleep(1000)
    elif what == "spin":
        while True:
            pass
    elif what == "segfault":
        ctypes.string_at(0)
    elif what == "exit":
        os._exit(3)
    elif what == "memory":
        return len(bytearray(2**33))
    return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not)."""
    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def live_children() -> list[psutil.Process]:
    """This process's descendants that still run."""
    return [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
