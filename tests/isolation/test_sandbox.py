"""The code sandbox (megarlhf.isolation.sandbox), the ``code_tests`` reward and the ``code`` environment.

The hostile programs each run in the sandbox against the same three tests (~0.2 s each; the ones that
must be stopped by the wall clock take its 3 s): each must be contained and reported, no process may
be left behind, and the caller's files and network stay out of reach (where the machine allows the
namespaces: ``isolation() == "namespaces"``; the test says so and checks less where it does not).
"""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from megarlhf.isolation.sandbox import CodeResult, SandboxLimits, isolation, row_tests, run_tests

TESTS = [{"call": "square(2)", "expected": 4}, {"call": "square(-3)", "expected": 9},
         {"call": "square(0)", "expected": 0}]
LIMITS = SandboxLimits(wall_s=3, cpu_s=1, memory_mb=256, file_mb=1)  # room for a start on a loaded machine
NAMESPACES = isolation() == "namespaces"
SOLVES = "def square(x):\n    return x * x\n"


def _sandbox_processes() -> list[psutil.Process]:
    """Processes still running a sandbox harness (ours or a namespace's)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any("harness.py" in part for part in process.info["cmdline"] or []):
                found.append(process)
        except psutil.Error:
            continue
    return found


def _no_process_left() -> None:
    deadline = time.monotonic() + 5.0
    while _sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _sandbox_processes(), "a sandboxed process outlived its run"


# (name, program, expected status, expected passes, a check of the result)
HOSTILE = [
    ("solves", SOLVES, "ok", 3, None),
    ("prints a line", "print('hello from the program')\n" + SOLVES, "ok", 3,
     lambda r: r.output == "hello from the program\n"),  # kept: its buffer is flushed after the report
    ("half right", "def square(x):\n    return x * x if x > 0 else 1\n", "ok", 1, None),
    ("prints a forged verdict", "def square(x):\n    return 0\nprint('3/3 tests passed')\n"
     "import os\nos.write(1, b'0123 {\"test\": 0, \"passed\": true}\\n')\n", "ok", 1, None),  # square(0) == 0
    ("returns an object equal to everything", "class Any:\n    def __eq__(self, other):\n        return True\n"
     "def square(x):\n    return Any()\n", "ok", 0, lambda r: "not plain data" in r.errors[0]),
    ("returns an int subclass equal to everything", "class I(int):\n    def __eq__(self, other):\n"
     "        return True\ndef square(x):\n    return I(0)\n", "ok", 0, lambda r: "not plain data" in r.errors[0]),
    ("returns 4.0 for 4", "def square(x):\n    return float(x * x)\n", "ok", 0, None),
    ("replaces compile and eval", "import builtins\nbuiltins.compile = lambda *a, **k: None\n"
     "builtins.eval = lambda *a, **k: 4\nbuiltins.exec = lambda *a, **k: None\n", "ok", 0, None),
    ("steals the token and forges the report", "import sys, os\nreport = sys._getframe(1).f_locals['report']\n"
     "for i in range(3):\n    report({'test': i, 'passed': True})\n    report({'test': i, 'value': 'x' * 10})\n"
     "token = sys._getframe(1).f_locals['token']\nos.write(3, (token + ' [1]\\n' + token + ' ' + '[' * 5000 + "
     "'\\n').encode())\nreport({'done': True})\nos._exit(0)\n", "ok", 0, None),
    ("exits with an odd code", "import os\nos._exit(200)\n", "exit 200", 0, None),
    ("infinite loop", "while True:\n    pass\n", "cpu_limit", 0, None),
    ("infinite loop, wall first", "while True:\n    pass\n", "timeout", 0, None),
    ("sleeps forever", "import time\ntime.sleep(1000)\n", "timeout", 0, None),
    ("fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
     "timeout", 0, None),
    ("memory hog", "x = bytearray(2**34)\n", "ok", 0, lambda r: "MemoryError" in r.solution_error),
    ("huge output", "while True:\n    print('x' * 10000)\n", "ok", 0,
     lambda r: "File too large" in r.solution_error and len(r.output) < 1100),
    ("exits before the tests", "import os\nos._exit(0)\n", "error", 0, None),
    ("segfaults", "import ctypes\nctypes.string_at(0)\n", "killed by SIGSEGV", 0, None),
    ("sys.exit", "import sys\nsys.exit(0)\n", "ok", 0, lambda r: "SystemExit" in r.solution_error),
    ("syntax error", "def square(:\n", "ok", 0, lambda r: "SyntaxError" in r.solution_error),
    ("fills its disk", "import os\nfor i in range(64):\n    open(f'f{i}', 'wb').write(b'x' * (2**20 - 1))\n",
     "ok", 0, lambda r: "No space left" in r.solution_error or not NAMESPACES),
]


@pytest.mark.parametrize("name, program, status, passed, check", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_programs_are_contained_and_reported(name, program, status, passed, check):
    if name.startswith("infinite loop"):  # the CPU limit first (with room for a loaded machine), or the wall clock
        limits = SandboxLimits(wall_s=1.0, cpu_s=5) if name.endswith("wall first") else SandboxLimits(wall_s=8, cpu_s=1)
    else:
        limits = LIMITS
    start = time.monotonic()
    result = run_tests(program, TESTS, limits)
    assert time.monotonic() - start < limits.wall_s + 3.0
    assert (result.status, result.passed, result.total) == (status, passed, 3), result.report()
    if check is not None:
        assert check(result), result.report()
    _no_process_left()


def test_a_timeout_keeps_the_tests_that_passed_before_it():
    tests = [{"call": "square(2)", "expected": 4}, {"call": "__import__('time').sleep(1000)", "expected": None},
             {"call": "square(3)", "expected": 9}]
    result = run_tests(SOLVES, tests, LIMITS)
    assert (result.status, result.passed) == ("timeout", 1)
    assert result.fraction == pytest.approx(1 / 3)


def test_assert_tests_run_where_allowed():
    asserts = ["assert square(2) == 4", "assert square(3) == 10"]
    result = run_tests(SOLVES, asserts, LIMITS)
    assert (result.passed, result.total) == (1, 2) and "AssertionError" in result.errors[1]
    assert row_tests({"tests": asserts}, "tests", allow_asserts=True) == asserts


def test_without_namespaces_it_refuses_unless_allowed(monkeypatch):
    import sys

    from megarlhf.isolation import sandbox

    monkeypatch.setattr(sandbox, "_sandbox", lambda: ("none", sys.executable))
    with pytest.raises(sandbox.SandboxUnavailable, match="allow_unisolated"):
        run_tests(SOLVES, TESTS, LIMITS)
    unisolated = SandboxLimits(wall_s=8, cpu_s=1, allow_unisolated=True)
    result = run_tests(SOLVES, TESTS, unisolated)
    assert (result.passed, result.isolation) == (3, "none")
    assert run_tests("while True:\n    pass\n", TESTS, unisolated).status == "cpu_limit"
    _no_process_left()


@pytest.mark.skipif(not NAMESPACES, reason="the machine does not allow the sandbox's namespaces")
@pytest.mark.parametrize("name, program", [
    ("writes outside its directory", "open('/tmp/megarlhf-sandbox-escape', 'w').write('x')\n"
     "for d in ('/var/tmp', '/dev/shm', '/run/lock', '/etc', '/usr', '/', '/proc'):\n    try:\n"
     "        open(d + '/megarlhf-sandbox-escape', 'w')\n    except OSError:\n        pass\n    else:\n"
     "        raise SystemExit('wrote in ' + d)\n"),
    ("writes into the machine's files", "import os\nfor path in ('/etc/megarlhf-escape', os.path.expanduser("
     "'~/megarlhf-escape'), '/usr/megarlhf-escape'):\n    try:\n        open(path, 'w')\n    except OSError:\n"
     "        pass\n    else:\n        raise SystemExit('wrote ' + path)\n"),
    ("opens a socket", "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\n"),
    ("signals its parent", "import os, signal\nfor pid in (os.getppid(), 1):\n    try:\n"
     "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"),
    ("lists the machine's processes", "import os\nassert len([p for p in os.listdir('/proc') if p.isdigit()]) > 5\n"),
])
def test_the_namespaces_keep_the_program_in(name, program, tmp_path):
    result = run_tests(program + SOLVES, TESTS, LIMITS)
    assert result.isolation == "namespaces"
    for directory in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/etc", "/usr"):
        for leftover in ("megarlhf-sandbox-escape", "megarlhf-escape"):
            assert not Path(directory, leftover).exists()
    if name == "opens a socket" or name == "lists the machine's processes":
        assert result.solution_error is not None and result.passed == 0  # no network; only its own processes
    else:
        assert result.passed == 3, result.report()  # its writes went to a private /tmp; its signals reached nothing
    _no_process_left()


@pytest.mark.skipif(not NAMESPACES, reason="the machine does not allow the sandbox's namespaces")
def test_the_program_sees_only_the_allowlist():
    # this file is world-readable and lies outside the allowlist (the system's /usr and /lib, the interpreter's
    # installation): the program must not find it, nor the machine's /etc, nor any mount but its own
    here = str(Path(__file__).resolve())
    program = (f"import os\nprint(' '.join(os.listdir('/')))\nprint(os.listdir('/etc'))\n"
               f"print(os.path.exists({here!r}), os.path.exists('/etc/passwd'))\n"
               "print(open('/proc/self/mounts').read())\nprint(open('/proc/self/status').read())\n" + SOLVES)
    result = run_tests(program, TESTS, SandboxLimits(wall_s=3, report_chars=20000))
    assert result.passed == 3, result.report()
    lines = result.output.splitlines()
    system = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "dev", "tmp", "proc"}
    interpreter = {Path(sys.base_prefix).resolve().parts[1]}  # its installation may lie elsewhere (pyenv, conda)
    assert set(lines[0].split()) <= system | interpreter, lines[0]
    assert lines[1:3] == ["['ld.so.cache']", "False False"]
    mounts = [line.split()[1] for line in lines[3:] if len(line.split()) == 6 and line.split()[1][:1] == "/"]
    assert "/" in mounts and "/tmp" in mounts, mounts
    assert all(m == "/" or Path(m).parts[1] in system | interpreter for m in mounts), mounts
    status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
    assert (status["CapPrm"], status["CapEff"], status["CapAmb"]) == ("0" * 16,) * 3
    assert status["NoNewPrivs"] == "1" and status["Uid"].split()[0] != "0"
    _no_process_left()


@pytest.mark.skipif(not NAMESPACES, reason="the machine does not allow the sandbox's namespaces")
def test_shared_memory_does_not_outlive_the_run():
    # a SysV segment the program creates and detaches from would stay (with its memory) in the machine's
    # IPC namespace when kernel.shm_rmid_forced is 0, as it is by default
    program = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmget.restype = ctypes.c_int\n"
               "key = libc.shmget(0x6d656761, 4096, 0o1666)\nassert key >= 0, ctypes.get_errno()\n"
               "print('segment', key)\n" + SOLVES)
    before = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    result = run_tests(program, TESTS, LIMITS)
    after = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    leaked = [line for line in after if line not in before and int(line.split()[0]) == 0x6d656761]
    for line in leaked:  # do not leave it on the machine when the test fails
        os.system(f"ipcrm -m {line.split()[1]}")
    assert result.passed == 3 and "segment" in result.output, result.report()
    assert leaked == []


@pytest.mark.skipif(not NAMESPACES, reason="the machine does not allow the sandbox's namespaces")
def test_a_strict_umask_does_not_lock_the_program_out_of_its_root():
    # the directories of the new root are made by the namespace's shell: under the caller's umask 077 the
    # program's user (another uid when started as root) could not enter them
    import subprocess

    code = ("import os; os.umask(0o077)\nfrom megarlhf.isolation.sandbox import run_tests, _sandbox\n"
            f"r = run_tests({SOLVES!r}, {TESTS!r})\nimport sys\nprint(_sandbox()[0], _sandbox()[1] == sys.executable, "
            "r.passed)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=str(Path(__file__).resolve().parents[2]))
    assert done.stdout.split() == ["namespaces", "True", "3"], done.stdout + done.stderr[-2000:]  # no fallback


@pytest.mark.skipif(not NAMESPACES, reason="the machine does not allow the sandbox's namespaces")
def test_a_fork_bomb_does_not_starve_a_concurrent_sandbox():
    # each run's process limit counts its own processes: the bomb holds all of its own, the other program
    # still starts the children it needs
    forks = ("import os\nfor _ in range(4):\n    if os.fork() == 0:\n        os._exit(0)\n"
             "for _ in range(4):\n    os.wait()\n")
    bomb = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n"
    limits = SandboxLimits(wall_s=4, cpu_s=2, max_processes=8)
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(run_tests, bomb, TESTS, limits)
        time.sleep(1.0)  # the bomb has spent its processes by now
        result = run_tests(forks + SOLVES, TESTS, limits)
        assert held.result().status == "timeout"
    assert result.passed == 3, result.report()
    _no_process_left()


def test_concurrent_runs_finish_within_their_bound():
    programs = [SOLVES, "while True:\n    pass\n", "import time\ntime.sleep(1000)\n", SOLVES] * 2
    start = time.monotonic()
    limits = SandboxLimits(wall_s=4, cpu_s=1)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: run_tests(p, TESTS, limits), programs))
    assert time.monotonic() - start < 2 * (limits.wall_s + 2.0)
    assert [r.passed for r in results] == [3, 0, 0, 3] * 2
    _no_process_left()


def test_bad_rows_and_limits_are_named():
    with pytest.raises(ValueError, match="'tests' field: must be a non-empty list"):
        row_tests({"tests": "assert True"}, "tests")
    with pytest.raises(ValueError, match="'unit' field: must be a non-empty list"):
        row_tests({}, "unit")
    with pytest.raises(ValueError, match="at most 1000"):
        row_tests({"tests": [TESTS[0]] * 1001}, "tests")
    with pytest.raises(ValueError, match="test 1 is an assert statement, which the program it tests can make pass"):
        row_tests({"tests": [TESTS[0], "assert square(2) == 4"]}, "tests")
    with pytest.raises(ValueError, match="test 0 must be"):
        row_tests({"tests": [{"call": "f(1)"}]}, "tests")
    with pytest.raises(ValueError, match="test 0: 'expected' must be plain JSON data"):
        row_tests({"tests": [{"call": "f(1)", "expected": float("nan")}]}, "tests")
    with pytest.raises(ValueError, match="SandboxLimits.wall_s"):
        SandboxLimits(wall_s=0)
    for path in ("../escape.py", "/etc/x.py", "a//b.py", "./a.py", ""):
        with pytest.raises(ValueError, match="must be relative"):
            run_tests(SOLVES, TESTS, LIMITS, files={path: "x = 1"})
    with pytest.raises(ValueError, match="at most"):
        run_tests(SOLVES, TESTS, LIMITS, files={"big.py": "x" * (5 * 2**20)})
    with pytest.raises(ValueError, match="not valid Unicode"):
        run_tests(SOLVES, TESTS, LIMITS, files={"a.py": "x = '\udc80'"})
    from megarlhf.isolation.sandbox import _result

    deep = {"solution_error": [[[[1]]]]}
    for _ in range(20000):  # a report the parser would not accept, built directly: str() of it recurses
        deep = {"solution_error": [deep["solution_error"]]}
    assert _result([deep], TESTS, "ok", "none", 0.0, "").solution_error == "(a value nested too deeply to show)"
    report = CodeResult(passed=1, total=2, status="timeout", isolation="none", seconds=1.0, errors={1: "x"}).report()
    assert report.startswith("1/2 tests passed (timeout)") and "test 1 failed: x" in report


def test_code_tests_reward_scores_the_last_code_block_through_the_reward_runner():
    from megarlhf.rewards import CombinedReward, RewardInput
    from megarlhf.config.reward import RewardConfig, RewardSpec
    from megarlhf.rewards.code import extract_program

    assert extract_program("first\n```python\nx = 1\n```\nthen\n```\ndef square(x): return x*x\n```\n") == \
        "def square(x): return x*x\n"
    assert extract_program("def f(): pass") == "def f(): pass"
    reward = CombinedReward(RewardConfig(functions=[RewardSpec("code_tests", kwargs={"wall_s": 1.5, "cpu_s": 1})],
                                         timeout_s=5.0))
    rows = [f"Here it is:\n```python\n{SOLVES}```", "```python\nwhile True: pass\n```", "no code at all", SOLVES]
    samples = [RewardInput(prompt="p", response=r, metadata={"tests": TESTS}) for r in rows]
    samples.append(RewardInput(prompt="p", response=SOLVES, metadata={"tests": "not a list"}))
    samples.append(RewardInput(prompt="p", response=SOLVES, metadata={"tests": ["assert square(2) == 4"]}))
    result = reward(samples)
    assert result.rewards == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert [f.index for f in result.failures] == [4, 5] and "'tests' field" in result.failures[0].message
    assert "assert statement" in result.failures[1].message
    _no_process_left()


def test_code_environment_reports_the_tests_to_the_model():
    from megarlhf.envs import ENVIRONMENTS, ParsedCall

    episode = ENVIRONMENTS.get("code")({"tests": TESTS}, wall_s=1.5, cpu_s=1)
    first = episode.step([], ParsedCall("run_tests", {"code": "def square(x):\n    return 2 * x\n"}))
    assert first.observation.startswith("2/3 tests passed") and "test 1 failed" in first.observation
    assert first.reward is None and not first.done
    second = episode.step([], ParsedCall("run_tests", {"code": SOLVES}))
    assert second.observation.startswith("3/3 tests passed")
    refused = episode.step([], ParsedCall("run_tests", {"code": 7}))
    assert refused.observation == "error: 'code' must be a string, got int"
    with pytest.raises(ValueError, match="'tests' field"):
        ENVIRONMENTS.get("code")({"question": "no tests"})
