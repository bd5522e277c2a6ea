"""The suite's time budget (tests/conftest.py): past ``MEGARLHF_TEST_DEADLINE`` a test is skipped with a reason
that names the budget; before it, tests run."""
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(deadline: float) -> str:
    env = {**os.environ, "MEGARLHF_TEST_DEADLINE": str(deadline)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "tests/core/test_seeds.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return done.stdout


def test_tests_after_the_deadline_are_skipped_naming_the_budget():
    spent = _run(time.time() - 1)
    assert " skipped" in spent and " passed" not in spent, spent
    assert "time budget (MEGARLHF_TEST_DEADLINE) was spent" in spent
    ample = _run(time.time() + 3600)
    assert " passed" in ample and " skipped" not in ample, ample
