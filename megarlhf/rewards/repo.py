"""The ``repo_tests`` reward: the share of a row's hidden tests that pass on the repository a ``repo``
episode left (:mod:`megarlhf.envs.repo`).

The repository is the row's with the ``edit`` calls of the model's turns replayed, as the environment
replays them, except the last turn's: a call in an episode's last turn either was not run (the turn limit)
or its result never reached the model. The hidden tests are call tests run in the code sandbox; their
expected values never enter it. A single-turn sample (no turns) scores the row's repository unedited.
"""
from __future__ import annotations

from megarlhf.envs.repo import check_parser, replay, row_repository
from megarlhf.isolation.sandbox import SandboxLimits, row_tests, run_tests
from megarlhf.rewards.api import REWARDS, RewardInput, in_process


@REWARDS.register("repo_tests")
@in_process  # the tests run in the sandbox's own child process; this call only waits for it
def repo_tests(sample: RewardInput, parser: str = "hermes", wall_s: float = 5.0, cpu_s: int = 5,
               memory_mb: int = 512, allow_unisolated: bool = False) -> float:
    """Share of the row's ``hidden_tests`` passing on the repository the episode left (module docstring)."""
    check_parser(parser)
    files, program = row_repository(sample.metadata)
    tests = row_tests(sample.metadata, "hidden_tests")
    limits = SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, allow_unisolated=allow_unisolated)
    edited = replay(files, sample.turns[:-1], parser)
    return run_tests(program, tests, limits, files=edited).fraction
