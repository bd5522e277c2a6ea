"""Suite-wide hook: an optional time budget, for runs under a hard limit (CI: .ci/run).

``MEGARLHF_TEST_DEADLINE`` (seconds since the epoch): a test that would start after it is skipped, with a
reason that says so (pytest -rs prints every skip's reason), so a run with a hard wall-clock limit ends
inside it and reports which tests it did not run, instead of being killed with nothing reported. A test
that has started runs to its end. Unset: no budget.
"""
import os
import time

import pytest

DEADLINE = "MEGARLHF_TEST_DEADLINE"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    deadline = os.environ.get(DEADLINE)
    if deadline and time.time() > float(deadline):
        pytest.skip(f"not started: the run's time budget ({DEADLINE}) was spent")
