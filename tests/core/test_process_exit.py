"""megarlhf.core.process_exit: a command's process ends with its exit status, after every at-exit handler
(temporary directories removed, buffered output written), without the interpreter's teardown; while another
non-daemon thread runs, the exit is a normal one (the thread finishes)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import atexit, sys, tempfile, threading, time
    from megarlhf.core.process_exit import exit_process

    class Teardown:
        def __del__(self):
            print("teardown", flush=True)

    keep = Teardown()  # a module global: only the interpreter's teardown collects it
    scratch = tempfile.TemporaryDirectory()
    print(scratch.name, flush=True)
    atexit.register(lambda: print("atexit handler", flush=True))
    if sys.argv[1] == "thread":
        threading.Thread(target=lambda: (time.sleep(0.5), print("thread done", flush=True))).start()
    sys.stdout.write("buffered, unflushed")
    exit_process(3)
""")


def run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)


def test_exit_runs_the_exit_handlers_and_skips_the_teardown():
    proc = run("plain")
    assert proc.returncode == 3, proc.stderr
    lines = proc.stdout.splitlines()
    assert not Path(lines[0]).exists()  # TemporaryDirectory's finalizer ran
    assert "atexit handler" in proc.stdout and "buffered, unflushed" in proc.stdout
    assert "teardown" not in proc.stdout  # the interpreter's finalization was skipped


def test_a_running_thread_gets_a_normal_exit():
    proc = run("thread")
    assert proc.returncode == 3, proc.stderr
    assert "thread done" in proc.stdout and "atexit handler" in proc.stdout
    assert not Path(proc.stdout.splitlines()[0]).exists()
