"""The ``reward`` section: weighted reward functions (registered names or dotted paths), their time and
memory limits, and a learned reward model."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megarlhf.config.validate import check, check_timeout


@dataclass
class RewardSpec:
    """One weighted term of the reward: a registered name or a dotted path, its weight and kwargs."""

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        check(isinstance(self.name, str) and bool(self.name), f"RewardSpec.name must be a non-empty string, got "
              f"{self.name!r}")


@dataclass
class RewardConfig:
    """How rewards are computed (the only place their defaults live)."""

    # may be empty where a reward model or the multi-turn environment's own rewards (rollout.env) score the samples
    functions: list[RewardSpec] = field(default_factory=lambda: [RewardSpec("math_verify")])
    timeout_s: float = 10.0  # per call; a call that runs longer gets failure_reward and a report
    failure_reward: float = 0.0  # reward of a call that raised, timed out or returned a non-number
    num_workers: int = 4  # threads, and worker processes, running reward calls concurrently
    worker_memory_mb: int = 4096  # address-space limit of each reward worker process
    reward_model_path: str | None = None  # HF ...ForSequenceClassification directory (e.g. `megarlhf rm`'s export)
    reward_model_weight: float = 1.0  # weight of the reward model's score when reward_model_path is set
    # standardise the reward model's scores with the mean / std stored with it (megarlhf_reward_stats.json)
    reward_model_normalize: bool = False
    reward_model_clip: float | None = None  # clip the (normalised) score to [-clip, clip]; None: no clip

    def __post_init__(self):
        if self.reward_model_clip is not None and not self.reward_model_clip > 0:
            raise ValueError(f"RewardConfig.reward_model_clip must be > 0 or null, got {self.reward_model_clip}")
        check_timeout(self.timeout_s, "RewardConfig.timeout_s")
        for name in ("num_workers", "worker_memory_mb"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"RewardConfig.{name} must be an int >= 1, got {value!r}")
        names = [spec.name for spec in self.functions]
        if len(set(names)) != len(names):
            raise ValueError(f"RewardConfig.functions names a function twice: {names}")
