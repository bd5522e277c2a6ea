"""Memory planner and dry run: per-rank bytes of an RL recipe on a given layout, without GPUs or weights.

* :mod:`.shapes`  model shapes from an HF config.json or a named public preset; per-rank parameters;
* :mod:`.memory`  the per-rank, per-phase memory plan of the colocate schedule;
* :mod:`.suggest` the smallest change that makes a refused plan fit;
* :mod:`.command` ``megarlhf plan RECIPE [overrides]``.
"""
from megarlhf.planner.memory import Launch, MemoryPlan, StagePlan, plan_memory
from megarlhf.planner.shapes import PRESETS, ModelShape, resolve_shape
from megarlhf.planner.suggest import Change, suggest

__all__ = ["Change", "Launch", "MemoryPlan", "ModelShape", "PRESETS", "StagePlan", "plan_memory",
           "resolve_shape", "suggest"]
