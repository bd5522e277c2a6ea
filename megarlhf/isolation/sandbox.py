"""Runs model-written Python against unit tests in a fresh, limited, killable child process.

:func:`run_tests` is the one entry point (the ``code_tests`` reward and the ``code`` environment use it).
The program and its tests reach a child interpreter on stdin (:mod:`megarlhf.isolation.sandbox_harness`, standard
library only, started with ``python -I -c``); nothing is written where the child could replace it, and
the parent reads the child's results and output only through file descriptors it holds.

**Tests.** A *call test* ``{"call": "square(3)", "expected": 9}`` sends only the call into the sandbox;
the child reports the call's value as plain JSON data (exactly int, float, str, bool, None, list and
dict: no subclass, so no object with its own ``__eq__``) and the parent compares it with ``expected``
(as JSON, so ``1``, ``1.0`` and ``true`` differ). The expected values never enter the sandbox, so a
program scores only by computing them. An *assert test* ``"assert square(3) == 9"`` passes if it raises
nothing; it runs in the program's process, so a program can make it pass without solving anything
(replace ``compile``, return an object equal to everything, forge the report): usable as feedback (the
``code`` environment), refused by the ``code_tests`` reward unless ``allow_asserts``.

**Bounds** (``prlimit`` on the child): CPU time (``RLIMIT_CPU``: SIGXCPU, then SIGKILL a second later),
address space (``RLIMIT_AS``), largest file written (``RLIMIT_FSIZE``, which also caps its output and
report), open files, no core dumps; a wall-clock limit enforced by the parent (the child's process
tree is killed with SIGKILL); and ``PR_SET_PDEATHSIG``, so the sandbox dies with the thread that started
it. Isolation (:func:`isolation`, probed once per process):

* ``"namespaces"`` (``unshare``): new PID, mount, IPC and network namespaces, and an empty root. No network
  but loopback; ``/proc`` shows only the sandbox's processes; SysV and POSIX IPC objects are its own and
  go with it. The program sees an allowlist, read-only: the system's ``/usr`` (and ``/bin``, ``/lib``...),
  the installation of the interpreter (``sys.base_prefix``, never a home directory), ``/etc/ld.so.cache``,
  ``/dev/null``, ``/dev/zero``, ``/dev/urandom``; its one writable place is a private, size-capped tmpfs
  ``/tmp`` (the working directory). Nothing else of the machine exists for it (home directories, datasets,
  checkpoints, ``/etc``, the trainer's files), world-readable or not. It runs with no capabilities and
  ``no_new_privs`` (set-user-ID programs and file capabilities give it nothing): started as root, as a
  fresh user per run (drawn from 2**31 + [0, 2**24)); started as another user, as user 65534 of a user
  namespace nested in the one that made the mounts, so the mounts are locked (it cannot unmount its
  ``/tmp`` or make its root writable, not even from a user namespace it makes itself); to the kernel it is
  then still the trainer's user (it can read the trainer's private files among the allowed ones, and use
  the trainer's kernel keyrings). ``RLIMIT_NPROC`` caps its processes, counted per run (per user as root,
  per user namespace otherwise): one sandbox's fork bomb does not starve another's. When the shell that is
  the namespaces' first process exits, every process in them is killed.

  Threat model: it holds against a program that tries to read or write the machine's files, reach the
  network, signal other processes, outlive its run, or exhaust processes, disk or CPU time beyond its
  limits. It does not hold against a kernel exploit (the program can make system calls, including user
  namespaces of its own: there is no seccomp filter), reads what the allowlist shows (the installed
  software: a package installed into the interpreter's own prefix, not a virtual environment, is
  readable), may use the session keyring it inherits, and does not bound the memory of a run as a whole:
  ``RLIMIT_AS`` bounds each of its up to ``max_processes`` processes, and memory held in tmpfs or
  ``memfd`` files (of its ``/tmp``, or of a tmpfs it mounts in a user namespace of its own) counts against
  no process limit (no cgroups); nor the machine's CPU and memory bandwidth.
* ``"none"``: ``unshare`` is missing or not permitted (e.g. a container without ``CAP_SYS_ADMIN``).
  Only the rlimits and the wall clock hold: the program can use the network and read and write what the
  user can. :func:`run_tests` refuses to run there unless ``SandboxLimits.allow_unisolated``.

Without cgroups, neither a run's total memory nor the machine's total CPU is contained: run fewer workers
than cores, on a machine with memory to spare.
"""
from __future__ import annotations

import functools
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HARNESS = Path(__file__).with_name("sandbox_harness.py")
MAX_TESTS = 1000
MAX_FILES, MAX_FILE_BYTES = 200, 4 * 2**20  # files written into the working directory before the program runs
_CHANNEL_BYTES = 2**20  # the most of the child's report the parent reads
_PROGRAM_UID = 65534  # the program's user inside its own user namespace (a trainer that is not root)
_UID_RANGE = (2**31, 2**24)  # a root trainer runs each program as a fresh user drawn from [start, start + size)
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ENV = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8"}  # the child's whole environment
_SYSTEM_FILES = ("/etc/ld.so.cache", "/dev/null", "/dev/zero", "/dev/urandom")

# Run by the namespaces' first process (PID 1, which ignores signals it has no handler for) in its working
# directory, with three groups of arguments separated by "--": the directories to make in the new root (one
# argument, newline-separated, relative), the allowlist (:func:`_allowlist`), and the program's command. An
# empty tmpfs over the working directory becomes the new root; the allowed directories and files are bound
# into it read-only, nosuid and nodev (device files keep dev), as is any mount below them (a mount that
# cannot be made read-only is an error: the sandbox fails closed); the links are copied; a size-capped tmpfs
# /tmp (the working directory) and the PID namespace's own /proc are added; the old root is detached and the
# new one made read-only. The shell then runs the program as its child, so the program's own signals and
# limits end it as anywhere else and the shell reports how (128 + signal). Any failure before that exits.
_PREPARE = r"""set -ef
umask 022
root=$(pwd)
mount -t tmpfs -o size=1m,mode=755 megarlhf-sandbox "$root"
cd "$root"
IFS='
'
mkdir -p $1
shift 2
while [ "$1" != "--" ]; do
  kind=${1%%:*}; path=${1#*:}; shift
  case $kind in
    link) ln -s "${path#*=}" ".${path%%=*}" ;;
    dir) mount --rbind -o ro,nosuid,nodev "$path" ".$path" ;;
    device) : > ".$path"; mount --bind -o ro,nosuid "$path" ".$path" ;;
    file) : > ".$path"; mount --bind -o ro,nosuid,nodev "$path" ".$path" ;;
  esac
done
shift
export top="$root/"
writable='{m = $2; gsub(/\\040/, " ", m); gsub(/\\011/, "\t", m); gsub(/\\134/, "\\", m)}
  index(m, ENVIRON["top"]) == 1 && $4 !~ /^ro(,|$)/ {print m}'
awk "$writable" /proc/self/mounts > .writable
while read -r m; do mount -o remount,bind,ro,nosuid,nodev "$m"; done < .writable
awk "$writable" /proc/self/mounts > .writable
test ! -s .writable
rm .writable
unset top
mount -t tmpfs -o size=32m,mode=1777,nosuid,nodev tmpfs tmp
mount -t proc -o nosuid,nodev,noexec proc proc
pivot_root . .old
umount -l /.old
rmdir /.old
mount -o remount,bind,ro,nosuid,nodev /
cd /tmp
set +e
"$@"
exit $?
"""


class SandboxUnavailable(RuntimeError):
    """The machine cannot isolate the program, and running it unisolated was not allowed."""


@dataclass(frozen=True)
class SandboxLimits:
    """The bounds of one run (module docstring)."""

    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512  # address space of each process
    file_mb: int = 16  # largest file a process may write (its output and report included)
    max_processes: int = 16  # RLIMIT_NPROC of the program, counted per run (namespaces only)
    report_chars: int = 1000  # characters of the program's output kept
    allow_unisolated: bool = False  # run with rlimits only where namespaces are unavailable

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_mb", "file_mb", "max_processes", "report_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 10**7:
                raise ValueError(f"SandboxLimits.{name} must be a positive number below 1e7, got {value!r}")
        if not isinstance(self.allow_unisolated, bool):
            raise ValueError(f"SandboxLimits.allow_unisolated must be true or false, got {self.allow_unisolated!r}")


def _is_plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is JSON data a call test can expect (the harness's ``plain``, checked here)."""
    if depth > 100:
        return False
    if type(value) is float:
        return math.isfinite(value)
    if type(value) in (int, str, bool, type(None)):
        return True
    if type(value) is list:
        return all(_is_plain(item, depth + 1) for item in value)
    return type(value) is dict and all(type(k) is str and _is_plain(v, depth + 1) for k, v in value.items())


def _check_test(test: Any, index: int, where: str, allow_asserts: bool) -> None:
    if isinstance(test, str):
        if not allow_asserts:
            raise ValueError(f"{where} test {index} is an assert statement, which the program it tests can make "
                             f"pass without solving anything; write it as {{\"call\": ..., \"expected\": ...}} "
                             f"or allow assert tests (allow_asserts)")
        return
    if not (isinstance(test, dict) and set(test) == {"call", "expected"} and isinstance(test["call"], str)):
        raise ValueError(f"{where} test {index} must be {{\"call\": \"f(2)\", \"expected\": 4}} or an assert "
                         f"statement, got {str(test)[:80]!r}")
    if not _is_plain(test["expected"]):
        raise ValueError(f"{where} test {index}: 'expected' must be plain JSON data (finite numbers, strings, "
                         f"booleans, null, lists, objects), got {str(test['expected'])[:80]!r}")


def row_tests(metadata: dict, tests_field: str, allow_asserts: bool = False) -> list:
    """A dataset row's unit tests, checked (module docstring: call tests, and assert statements where
    ``allow_asserts``); errors name the field and the test."""
    tests = metadata.get(tests_field)
    where = f"the row's {tests_field!r} field:"
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"{where} must be a non-empty list of tests, got {type(tests).__name__}")
    if len(tests) > MAX_TESTS:
        raise ValueError(f"{where} has {len(tests)} tests (at most {MAX_TESTS})")
    for index, test in enumerate(tests):
        _check_test(test, index, where, allow_asserts)
    return tests


@dataclass
class CodeResult:
    """The outcome of :func:`run_tests`: ``passed`` of ``total`` tests, and how the run ended."""

    passed: int
    total: int
    # "ok" (ran to the end), "timeout" (wall clock), "cpu_limit", "killed by SIG...", "exit N" (a non-zero
    # exit), "error" (exited without finishing its tests)
    status: str
    isolation: str  # "namespaces" or "none" (module docstring)
    seconds: float
    errors: dict[int, str] = field(default_factory=dict)  # test index -> why it failed
    solution_error: str | None = None  # the program itself raised (every test fails)
    output: str = ""  # the start of what the program printed

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    def report(self, chars: int = 1000) -> str:
        """A short text for the model (a tool observation) or a log."""
        lines = [f"{self.passed}/{self.total} tests passed" + ("" if self.status == "ok" else f" ({self.status})")]
        if self.solution_error:
            lines.append(f"the program raised {self.solution_error}")
        lines += [f"test {i} failed: {e}" for i, e in sorted(self.errors.items())[:5]]
        if self.output:
            lines.append(f"output:\n{self.output}")
        text = "\n".join(lines)
        return text if len(text) <= chars else text[:chars] + "\n[report truncated]"


def _allowlist(python: str) -> list[str]:
    """What the program sees of the machine, read-only, as :data:`_PREPARE`'s arguments: the system's programs
    and libraries, the installation of the interpreter ``python`` when it is this process's (its
    ``sys.base_prefix``, which may lie elsewhere, e.g. a pyenv or conda tree; never a whole home directory or
    ``/``), the dynamic linker's cache and the harmless device files."""
    links, dirs = [], []
    for top in _SYSTEM_DIRS:
        if os.path.islink(top):
            links.append(f"link:{top}={os.readlink(top)}")
        elif os.path.isdir(top):
            dirs.append(top)
    prefixes = set()
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        prefixes = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
    homes = {os.path.realpath(os.path.expanduser("~")), "/root", "/home"}
    for prefix in sorted(prefixes):
        covered = any(prefix == d or prefix.startswith(d + "/") for d in dirs)
        if prefix not in homes | {"/"} and not covered and os.path.isdir(prefix):
            dirs.append(prefix)
    files = [f for f in _SYSTEM_FILES if os.path.exists(f)]
    made = {d.lstrip("/") for d in dirs} | {os.path.dirname(f).lstrip("/") for f in files} | {"tmp", "proc", ".old"}
    return ["\n".join(sorted(made)), "--", *links, *(f"dir:{d}" for d in dirs),
            *(f"{'device' if f.startswith('/dev/') else 'file'}:{f}" for f in files)]


def _command(python: list[str], limits: SandboxLimits, mode: str) -> list[str]:
    """The child's command line: the interpreter ``python`` (with its arguments) under the rlimits of
    ``limits`` (``prlimit``: set after fork, not in a pre-exec hook, which is unsafe in a threaded parent)
    and, with ``mode == "namespaces"``, in new PID, mount and network namespaces on the allowlist's root
    (module docstring), as a user with no capabilities and ``no_new_privs``: started as root, a fresh user
    drawn per run (so its process limit counts its own processes); started as another user, user 65534 of
    a user namespace nested in the one that made the mounts (so they are locked: they cannot be unmounted
    or made writable from inside, not even from a namespace the program makes itself)."""
    mb = 2**20
    caps = [f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}", f"--as={limits.memory_mb * mb}",
            f"--fsize={limits.file_mb * mb}", "--nofile=64", "--core=0"]
    if mode != "namespaces":  # no process cap: it would count every process of the trainer's user
        return ["prlimit", *caps, "--", *python]
    caps.append(f"--nproc={limits.max_processes}")
    python = [os.path.realpath(python[0]), *python[1:]]
    unshare = ["unshare", "--mount", "--net", "--pid", "--ipc", "--fork", "--kill-child", "--propagation=private"]
    if os.geteuid() == 0:
        uid = _UID_RANGE[0] + secrets.randbelow(_UID_RANGE[1])
        drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
                "--bounding-set=-all", "--inh-caps=-all"]
    else:
        unshare += ["--user", "--map-root-user"]
        drop = ["setpriv", "--no-new-privs", "unshare", "--user", f"--map-user={_PROGRAM_UID}",
                f"--map-group={_PROGRAM_UID}"]
    return [*unshare, "sh", "-c", _PREPARE, "sh", *_allowlist(python[0]), "--",
            "prlimit", *caps, "--", *drop, *python]


@functools.cache
def _sandbox() -> tuple[str, str]:
    """(isolation, interpreter), probed once: the namespaces if ``unshare`` can make them here and the
    program's user can start an interpreter in them (this one, or the system's ``python3``); else ``"none"``."""
    candidates = [sys.executable] + [p for p in (shutil.which("python3", path="/usr/bin:/bin"),) if p]
    tools = ("unshare", "setpriv", "mount", "umount", "pivot_root", "awk", "prlimit")
    if all(shutil.which(tool, path="/usr/bin:/bin:/usr/sbin:/sbin") for tool in tools):
        for python in candidates:
            try:
                with tempfile.TemporaryDirectory(prefix="megarlhf-sandbox-") as workdir:
                    done = subprocess.run(_command([python, "-I", "-c", "pass"], SandboxLimits(), "namespaces"),
                                          cwd=workdir, env=_ENV, capture_output=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if done.returncode == 0:
                return "namespaces", python
    return "none", sys.executable


def isolation() -> str:
    """How the sandbox isolates its child here: ``"namespaces"`` or ``"none"`` (module docstring)."""
    return _sandbox()[0]


def run_tests(program: str, tests: list, limits: SandboxLimits = SandboxLimits(),
              files: dict[str, str] | None = None) -> CodeResult:
    """Runs ``program`` and then each of ``tests`` (:func:`row_tests`' forms) in a sandbox (module docstring).
    ``files`` (relative path -> text, e.g. a small repository the program imports) are written into the
    program's working directory first, which is then first on its ``sys.path``."""
    if not isinstance(program, str):
        raise TypeError(f"run_tests: the program must be a string, got {type(program).__name__}")
    files = check_files(files or {})
    for index, test in enumerate(tests):
        _check_test(test, index, "run_tests:", allow_asserts=True)
    mode, python = _sandbox()
    if mode == "none" and not limits.allow_unisolated:
        raise SandboxUnavailable("the code sandbox cannot isolate programs on this machine (unshare cannot make "
                                 "PID, mount and network namespaces here: run as root or allow user namespaces); "
                                 "set allow_unisolated to run them with resource limits only")
    token = secrets.token_hex(16)
    request = json.dumps({"token": token, "program": program, "files": files,
                          "tests": [{"assert": t} if isinstance(t, str) else {"call": t["call"]} for t in tests]})
    harness = [python, "-I", "-c", HARNESS.read_text(encoding="utf-8")]
    start = time.monotonic()
    with tempfile.TemporaryFile() as channel, tempfile.TemporaryFile() as output, \
            tempfile.TemporaryDirectory(prefix="megarlhf-sandbox-") as workdir:
        command = ["setpriv", "--pdeathsig", "KILL", *_command(harness, limits, mode)]
        child = subprocess.Popen(command, cwd=workdir, env=_ENV,
                                 stdin=subprocess.PIPE, stdout=channel, stderr=output, start_new_session=True)
        status = _wait(child, request.encode(), limits.wall_s)
        channel.seek(0)
        output.seek(0)
        reports = _read_reports(channel.read(_CHANNEL_BYTES), token)
        printed = _start_of(output.read(limits.report_chars * 4), limits.report_chars)
    return _result(reports, tests, status, mode, time.monotonic() - start, printed)


def check_files(files: Any) -> dict[str, str]:
    """``files`` if it maps relative paths (no ``..``, no absolute path) to texts, at most :data:`MAX_FILES`
    of them and :data:`MAX_FILE_BYTES` in all; else ValueError naming the path."""
    if not isinstance(files, dict) or len(files) > MAX_FILES:
        raise ValueError(f"run_tests: files must be a mapping of at most {MAX_FILES} paths to texts")
    size = 0
    for path, text in files.items():
        parts = path.split("/") if isinstance(path, str) else []
        if not parts or path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in path:
            raise ValueError(f"run_tests: file path {path!r} must be relative, without '.', '..' or empty parts")
        if not isinstance(text, str):
            raise ValueError(f"run_tests: file {path!r} must be text, got {type(text).__name__}")
        try:
            size += len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise ValueError(f"run_tests: file {path!r} holds text that is not valid Unicode "
                             f"(a lone surrogate)") from None
    if size > MAX_FILE_BYTES:
        raise ValueError(f"run_tests: the files hold {size} bytes (at most {MAX_FILE_BYTES})")
    return files


def _wait(child: subprocess.Popen, request: bytes, wall_s: float) -> str:
    try:
        child.communicate(input=request, timeout=wall_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # its session; with namespaces, unshare takes the namespace down
        except ProcessLookupError:
            pass
        child.wait()
        return "timeout"
    return _exit_status(child.returncode)


def _exit_status(code: int) -> str:
    """How the child ended: a signal is a negative code, or 128 + signal from the namespace's shell (which a
    program can also fake by exiting with that code: the status informs, the score does not depend on it)."""
    if code == 0:
        return "ok"
    number = -code if code < 0 else code - 128 if code > 128 else None
    try:
        name = signal.Signals(number).name if number is not None else None
    except ValueError:
        name = None
    if name is None:
        return f"exit {code}"
    return "cpu_limit" if name == "SIGXCPU" else f"killed by {name}"


def _start_of(data: bytes, chars: int) -> str:
    text = data.decode("utf-8", "replace")
    return text if len(text) <= chars else text[:chars] + "\n[output truncated]"


def _read_reports(data: bytes, token: str) -> list[dict]:
    """The token-tagged JSON objects of the child's report (anything else is ignored)."""
    reports = []
    for line in data.decode("utf-8", "replace").splitlines():
        head, _, body = line.partition(" ")
        if head != token:
            continue
        try:
            record = json.loads(body)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict):
            reports.append(record)
    return reports


def _same(value: Any, expected: Any) -> bool:
    """Equal as JSON data: types matter (1, 1.0 and true differ), as does every element."""
    try:
        return json.dumps(value, sort_keys=True) == json.dumps(expected, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        return False


def _shown(value: Any, chars: int = 300) -> str:
    """The start of ``str(value)`` for a report; a value nested too deep to print is described instead."""
    try:
        return str(value)[:chars]
    except RecursionError:
        return "(a value nested too deeply to show)"


def _result(reports: list[dict], tests: list, status: str, mode: str, seconds: float, output: str) -> CodeResult:
    result = CodeResult(passed=0, total=len(tests), status=status, isolation=mode, seconds=seconds, output=output)
    seen = set()
    for record in reports:
        index = record.get("test")
        if "solution_error" in record:
            result.solution_error = _shown(record["solution_error"])
        elif type(index) is int and 0 <= index < len(tests) and index not in seen:
            seen.add(index)
            test = tests[index]
            if "error" in record:
                result.errors[index] = _shown(record["error"])
            elif isinstance(test, str):
                result.passed += record.get("passed") is True
            elif "value" in record and _same(record["value"], test["expected"]):
                result.passed += 1
            else:
                result.errors[index] = f"{test['call']} returned {_shown(record.get('value'), 100)}"
    if status == "ok" and not any(record.get("done") is True for record in reports) and result.solution_error is None:
        result.status = "error"  # exited without finishing its tests (os._exit, a closed channel, ...)
    return result
