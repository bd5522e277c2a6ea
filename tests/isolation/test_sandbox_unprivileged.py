"""The code sandbox started by a user who is not root, as clusters run trainers.

When the tests run as root, the sandbox is started as ``nobody`` (uid 65534) through ``setpriv`` with the
system's ``python3``, from a copy of the sandbox's two modules that this user can read; otherwise as the
user the tests run as. The program is root in no namespace that made its mounts: it cannot unmount the
cover of its ``/tmp``, remount its root read-write, or do either from a user namespace it makes itself,
and it cannot write anywhere this user can.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import megarlhf.isolation.sandbox as sandbox

SYSTEM_PYTHON = "/usr/bin/python3"
# the escape: every step prints its result, and the program writes into a directory the trainer's user can write
ESCAPE = r'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
MS_REMOUNT, MS_BIND, MNT_DETACH = 32, 4096, 2
def attempt(name, call):
    print(name, call(), ctypes.get_errno())
def write(target):
    try:
        open(os.path.join(target, "escaped"), "w").write("x")
        print("WROTE", target)
    except OSError as error:
        print("no write", type(error).__name__)
attempt("umount /tmp", lambda: libc.umount2(b"/tmp", MNT_DETACH))
attempt("remount / rw", lambda: libc.mount(None, b"/", None, MS_REMOUNT | MS_BIND, None))
write(TARGET)
attempt("unshare user+mount", lambda: libc.unshare(0x10000000 | 0x00020000))
attempt("umount /tmp (own namespace)", lambda: libc.umount2(b"/tmp", MNT_DETACH))
attempt("umount /usr (own namespace)", lambda: libc.umount2(b"/usr", MNT_DETACH))
attempt("remount / rw (own namespace)", lambda: libc.mount(None, b"/", None, MS_REMOUNT | MS_BIND, None))
attempt("remount /usr rw (own namespace)", lambda: libc.mount(None, b"/usr", None, MS_REMOUNT | MS_BIND, None))
write(TARGET)
write("/usr")
def square(x):
    return x * x
'''
RUNNER = r'''
import json, sys
from megarlhf.isolation.sandbox import SandboxLimits, isolation, run_tests
program, tests = json.load(sys.stdin)
result = run_tests(program, tests, SandboxLimits(wall_s=10, report_chars=5000))
print(json.dumps({"isolation": isolation(), "passed": result.passed, "output": result.output,
                  "solution_error": result.solution_error}))
'''
TESTS = [{"call": "square(3)", "expected": 9}]


def _run_unprivileged(program: str, tests: list) -> dict:
    """Runs ``program`` through ``run_tests`` in a process of an unprivileged user (module docstring)."""
    if os.geteuid() != 0:
        command, env = [shutil.which("python3") or SYSTEM_PYTHON, "-c", RUNNER], dict(os.environ)
        env["PYTHONPATH"] = str(Path(sandbox.__file__).parents[2])
        done = subprocess.run(command, input=json.dumps([program, tests]), env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)
    if not (os.path.exists(SYSTEM_PYTHON) and shutil.which("setpriv")):
        pytest.skip("needs the system's python3 and setpriv to start the sandbox as an unprivileged user")
    copy = Path(tempfile.mkdtemp(prefix="megarlhf-unprivileged-"))
    try:
        package = copy / "megarlhf" / "isolation"
        package.mkdir(parents=True)
        for name in ("sandbox.py", "sandbox_harness.py"):
            shutil.copy(Path(sandbox.__file__).with_name(name), package / name)
        for init in (copy / "megarlhf" / "__init__.py", package / "__init__.py"):
            init.write_text("")
        for path in [copy, *copy.rglob("*")]:
            path.chmod(0o755)
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON, "-c", RUNNER]
        done = subprocess.run(command, input=json.dumps([program, tests]), cwd=copy, capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "PYTHONPATH": str(copy)}, timeout=120)
    finally:
        shutil.rmtree(copy)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_an_unprivileged_trainers_sandbox_cannot_be_undone_from_inside():
    target = Path(tempfile.mkdtemp(prefix="megarlhf-escape-target-"))  # under /tmp: the cover it would unmount
    try:
        target.chmod(0o777)
        result = _run_unprivileged(f"TARGET = {str(target)!r}\n" + ESCAPE, TESTS)
        written = list(target.iterdir())
    finally:
        shutil.rmtree(target)
    if result["isolation"] != "namespaces":
        pytest.skip("this machine gives an unprivileged user no namespaces: the sandbox refuses to run there")
    assert result["passed"] == 1, result
    assert written == [], result["output"]
    steps = {line.rsplit(" ", 2)[0]: line.rsplit(" ", 2)[1:] for line in result["output"].splitlines()
             if line.split(" ")[0] in ("umount", "remount")}
    assert len(steps) == 6 and all(code == "-1" for code, _ in steps.values()), result["output"]
    assert "WROTE" not in result["output"] and result["output"].count("no write") == 3, result["output"]


def test_an_unprivileged_trainers_sandbox_has_a_process_limit_of_its_own():
    forks = "import os\nfor _ in range(64):\n    try:\n        os.fork() or os._exit(0)\n    except OSError:\n" \
            "        print('limited')\n        break\n" + "def square(x):\n    return x * x\n"
    result = _run_unprivileged(forks, TESTS)
    if result["isolation"] != "namespaces":
        pytest.skip("this machine gives an unprivileged user no namespaces: the sandbox refuses to run there")
    assert result["passed"] == 1 and "limited" in result["output"], result
