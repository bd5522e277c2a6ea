"""The ``code_tests`` reward: the fraction of a dataset row's unit tests that the response's Python passes,
run in the sandbox of :mod:`megarlhf.isolation.sandbox`.

Data: each row carries its tests under ``tests_field`` (default ``tests``), a list of call tests
``{"call": "add(2, 3)", "expected": 5}``: the call runs in the sandbox and its value is compared with
``expected`` outside it, so the program cannot see or fake the expected values. Assert statements
(``"assert add(2, 3) == 5"``) run inside the program's process, where a program can make them pass
without solving anything: they are refused unless ``allow_assert_tests`` (for trusted settings, e.g.
scoring a fixed model). The program is the last fenced code block of the response (```` ```python ...
``` ```` or a bare ```` ``` ```` fence), or the whole response when it has none. A run that times out
keeps the tests that passed before it was killed. Keep ``wall_s`` below ``reward.timeout_s`` (5 s and
10 s by default): the reward runner would otherwise give up on the call first and score it
``failure_reward``; the sandbox still kills the program at ``wall_s``. Where the machine cannot isolate
programs (:func:`megarlhf.isolation.sandbox.isolation` is ``"none"``) every call fails with the reason, unless
``allow_unisolated``.
"""
from __future__ import annotations

import re

from megarlhf.rewards.api import REWARDS, RewardInput, in_process
from megarlhf.isolation.sandbox import SandboxLimits, row_tests, run_tests

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_program(response: str) -> str:
    """The last fenced code block of ``response``, or all of it when there is none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


@REWARDS.register("code_tests")
@in_process  # the program runs in the sandbox's own child process; this call only waits for it
def code_tests(sample: RewardInput, tests_field: str = "tests", wall_s: float = 5.0, cpu_s: int = 5,
               memory_mb: int = 512, allow_assert_tests: bool = False, allow_unisolated: bool = False) -> float:
    """Fraction of the row's tests the response's program passes (module docstring)."""
    limits = SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, allow_unisolated=allow_unisolated)
    tests = row_tests(sample.metadata, tests_field, allow_asserts=allow_assert_tests)
    return run_tests(extract_program(sample.response), tests, limits).fraction
