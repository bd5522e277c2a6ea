"""The built-in ``code`` environment: the model may run Python against the row's unit tests and read the
result before it answers.

One tool, ``run_tests(code)``: ``code`` runs in the sandbox of :mod:`megarlhf.isolation.sandbox` against the
row's tests (the ``tests_field`` of the row, as the ``code_tests`` reward reads it), and the model reads
the report ("3/5 tests passed", the first failures, the start of its output). The episode itself gives no
reward: score the final answer with the ``code_tests`` reward, so that the model is paid for the program
it submits, not for the ones it tried. Keep ``wall_s`` below ``rollout.env.timeout_s`` (4 s and 5 s by
default), so that the sandbox ends a long program before the runner gives up on the call.
"""
from __future__ import annotations

from megarlhf.envs.api import ENVIRONMENTS, ToolEpisode, ToolError, ToolSpec, stateless
from megarlhf.isolation.sandbox import SandboxLimits, row_tests, run_tests

RUN_TESTS_TOOL = ToolSpec(
    name="run_tests",
    description="Runs a Python program against the task's unit tests and reports which pass.",
    parameters={"type": "object", "required": ["code"],
                "properties": {"code": {"type": "string", "description": "the whole program, e.g. def f(x): ..."}}},
)


@ENVIRONMENTS.register("code")
@stateless
def code_env(metadata: dict, tests_field: str = "tests", wall_s: float = 4.0, cpu_s: int = 4, memory_mb: int = 512,
             report_chars: int = 1000, allow_unisolated: bool = False) -> ToolEpisode:
    """An episode with one tool, ``run_tests(code)``, over this row's tests (module docstring)."""
    tests = row_tests(metadata, tests_field, allow_asserts=True)
    limits = SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, report_chars=report_chars,
                           allow_unisolated=allow_unisolated)

    def run(code):
        if not isinstance(code, str):
            raise ToolError(f"'code' must be a string, got {type(code).__name__}")
        return run_tests(code, tests, limits).report(report_chars)

    return ToolEpisode([RUN_TESTS_TOOL], {"run_tests": run})
