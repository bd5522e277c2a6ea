"""Rollout engines: the contract and registry (:mod:`.api`), what goes in and comes out of ``generate``
(:mod:`.sampling`), and the backends, each registered under its ``rollout.backend`` name: ``vllm``,
``hf`` (plain transformers) and ``fake`` (deterministic responses, for tests)."""
from megarlhf.rollout.engines import fake as _fake  # noqa: F401  (registers the built-in backends)
from megarlhf.rollout.engines import hf as _hf  # noqa: F401
from megarlhf.rollout.engines import vllm as _vllm  # noqa: F401
from megarlhf.rollout.engines.api import (ENGINES, EngineConfig, EngineHealth, EngineSpec, RolloutEngine, WeightBucket,
                                          build_engine)
from megarlhf.rollout.engines.sampling import RolloutBatch, SamplingConfig, greedy_sampling, rollout_sampling

__all__ = ["ENGINES", "EngineConfig", "EngineHealth", "EngineSpec", "RolloutEngine", "WeightBucket", "build_engine",
           "RolloutBatch", "SamplingConfig", "greedy_sampling", "rollout_sampling"]
