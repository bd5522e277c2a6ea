"""The reward registry, its one call signature, the reward settings, and dotted-path user functions.

Every reward in :data:`REWARDS` (and every user function named by a dotted path) has one signature::

    reward_fn(sample: RewardInput, **kwargs) -> float

``kwargs`` are the ``kwargs`` of the function's :class:`RewardSpec` in the run config. A reward is per
sample so that one failing or hanging call costs that sample only: ``runner.py`` runs each call in a
worker process it kills past the time limit, or, for functions declared :func:`in_process`, on a thread.
The learned reward model is not a registry entry: it scores a whole batch with a Megatron model on every
rank in lockstep, so it is a separate slot, :class:`RewardModel`, that the trainer fills and that
:class:`megarlhf.rewards.runner.CombinedReward` adds with its own weight.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from megarlhf.core.errors import ConfigError
from megarlhf.core.registry import Registry, is_dotted_path, load_object
from megarlhf.isolation.timed_calls import check_timeout


@dataclass(frozen=True)
class RewardInput:
    """One rollout sample as a reward function sees it."""

    prompt: str
    response: str
    ground_truth: Any = None  # the dataset's answer field (e.g. "19"), None when the data has none
    metadata: dict[str, Any] = field(default_factory=dict)  # the dataset row's other fields
    prompt_ids: tuple[int, ...] = ()  # the tokens the policy saw and produced (a reward model scores these)
    response_ids: tuple[int, ...] = ()


RewardFn = Callable[..., float]
REWARDS: Registry[RewardFn] = Registry("reward function")


def in_process(fn: RewardFn) -> RewardFn:
    """Declares a reward function safe and cheap on any input (bounded work, no unbounded parsing or
    symbolic maths of the response), so that it runs on a thread of the trainer's process. Every other
    function runs in a worker process the runner can kill (:mod:`megarlhf.isolation.process_pool`)."""
    fn.megarlhf_in_process = True
    return fn


def preload(*modules: str):
    """Declares modules a reward function imports when called (e.g. a heavy parser), which a worker process
    imports before it takes calls, so that no call's time limit pays for the import."""
    def mark(fn: RewardFn) -> RewardFn:
        fn.megarlhf_preload = modules
        return fn
    return mark


def runs_in_process(fn: RewardFn) -> bool:
    return getattr(fn, "megarlhf_in_process", False) is True


class RewardModel(Protocol):
    """The reward-model slot: scores a batch (called on every rank, in the main thread, no timeout,
    because a Megatron value-head model runs collectives). Returns one finite float per sample."""

    def __call__(self, samples: Sequence[RewardInput]) -> Sequence[float]: ...




def load_function(path: str) -> Callable:
    """Imports the reward function ``pkg.mod:fn`` or ``pkg.mod.fn``; errors name the path and what failed."""
    fn = load_object(path, "reward function")
    if not callable(fn):
        raise ConfigError(f"reward function {path!r} is a {type(fn).__name__}, not a callable")
    return fn


def resolve_reward(name: str) -> RewardFn:
    """A registered reward by name, else a user function by dotted path."""
    if name in REWARDS:
        return REWARDS.get(name)
    if is_dotted_path(name):
        return load_function(name)
    raise ConfigError(f"unknown reward function {name!r}; known: {', '.join(REWARDS.names())}, "
                      f"or a dotted path 'pkg.module:function'")


@dataclass
class RewardSpec:
    """One weighted term of the reward: a registered name or a dotted path, its weight and kwargs."""

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.name not in REWARDS and not is_dotted_path(self.name):
            raise ConfigError(f"unknown reward function {self.name!r}; known: {', '.join(REWARDS.names())}, "
                              f"or a dotted path 'pkg.module:function'")


@dataclass
class RewardConfig:
    """How rewards are computed (the only place their defaults live)."""

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
        if not self.functions and self.reward_model_path is None:
            raise ValueError("RewardConfig needs at least one reward function or a reward_model_path")
        check_timeout(self.timeout_s, "RewardConfig.timeout_s")
        for name in ("num_workers", "worker_memory_mb"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"RewardConfig.{name} must be an int >= 1, got {value!r}")
        names = [spec.name for spec in self.functions]
        if len(set(names)) != len(names):
            raise ValueError(f"RewardConfig.functions names a function twice: {names}")
