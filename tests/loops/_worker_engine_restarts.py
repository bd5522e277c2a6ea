"""Rank script for tests/loops/test_engine_restarts.py: the RL driver with engines that die once.
Usage: _worker_engine_restarts.py MODE DIE_AT RECIPE [OVERRIDES...]

Registers the ``dying`` backend: the fake engine (samples drawn from their seeds alone, scored by the weights it
holds), which on the job's last rank dies once, at its DIE_AT-th generation: ``during`` it (its health goes bad
and the call raises, as a vLLM engine core killed mid-generation), ``between`` (right after it returns, so the
next command finds it dead); or at the start of its DIE_AT-th weight load (``load``: a sync's buckets are on
their way); or ``none``. An engine rebuilt in its place does not die again.
"""
import os
import sys

from megarlhf.config import RunConfig, load_config
from megarlhf.loops.rl import train_rl
from megarlhf.rollout.engines.api import ENGINES, EngineHealth, EngineSpec
from megarlhf.rollout.engines.fake import FakeEngine

MODE, DIE_AT = sys.argv[1], int(sys.argv[2])


class DyingEngine(FakeEngine):
    """The fake engine, dying once as MODE says (module docstring)."""

    calls = loads = 0  # generations and weight loads on this rank, over every engine built on it
    died = False

    def _dies_now(self, mode: str, count: int) -> bool:
        last_rank = int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1
        due = MODE == mode and last_rank and not DyingEngine.died and count == DIE_AT
        if due:
            DyingEngine.died = self.dead = True
        return due

    def begin_load(self):
        DyingEngine.loads += 1
        if self._dies_now("load", DyingEngine.loads):
            raise RuntimeError("the engine core died (test)")
        return super().begin_load()

    def generate(self, prompts, sampling):
        DyingEngine.calls += 1
        if self._dies_now("during", DyingEngine.calls):
            raise RuntimeError("the engine core died (test)")
        batch = super().generate(prompts, sampling)
        self._dies_now("between", DyingEngine.calls)
        return batch

    def health(self) -> EngineHealth:
        if getattr(self, "dead", False):
            return EngineHealth(False, "EngineCore_0 exit code -9 (test)")
        return EngineHealth(True)


ENGINES.register("dying")(EngineSpec(build=DyingEngine.from_config))


def main() -> None:
    recipe, overrides = sys.argv[3], sys.argv[4:]
    train_rl(load_config(RunConfig, recipe, overrides))


if __name__ == "__main__":
    main()
