"""The reward registry, its one call signature, the reward settings, and dotted-path user functions.

Every reward in :data:`REWARDS` (and every user function named by a dotted path) has one signature::

    reward_fn(sample: RewardInput, **kwargs) -> float

``kwargs`` are the ``kwargs`` of the function's :class:`RewardSpec` in the run config. A reward is per
sample so that one failing or hanging call costs that sample only: ``runner.py`` runs each call in a
worker process it kills past the time limit, or, for functions declared :func:`in_process`, on a thread.
The learned reward model and the LLM judge are not registry entries: each scores a whole batch with a model on
every rank in lockstep (a Megatron model; a rollout engine), so each is a slot, a :class:`BatchScorer`, that the
trainer fills and that :class:`megarlhf.rewards.runner.CombinedReward` adds with its own weight.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from megarlhf.core.errors import ConfigError
from megarlhf.core.registry import Registry, is_dotted_path, load_object


@dataclass(frozen=True)
class RewardInput:
    """One rollout sample as a reward function sees it."""

    prompt: str
    response: str
    ground_truth: Any = None  # the dataset's answer field (e.g. "19"), None when the data has none
    metadata: dict[str, Any] = field(default_factory=dict)  # the dataset row's other fields
    prompt_ids: tuple[int, ...] = ()  # the tokens the policy saw and produced (a reward model scores these)
    response_ids: tuple[int, ...] = ()
    # a multi-turn episode's model turns, each decoded alone (``response`` joins them with newlines): a reward
    # that replays the episode's tool calls reads them turn by turn; () for a single-turn sample
    turns: tuple[str, ...] = ()
    question: str | None = None  # the row's question as written (chat mode: the last user message); None: prompt


RewardFn = Callable[..., float]
REWARDS: Registry[RewardFn] = Registry("reward function")


def in_process(fn: RewardFn) -> RewardFn:
    """Declares a reward function safe and cheap on any input (bounded work, no unbounded parsing or
    symbolic maths of the response), so that it runs on a thread of the trainer's process. Every other
    function runs in a worker process the runner can kill (:mod:`megarlhf.isolation.process_pool`)."""
    fn.megarlhf_in_process = True
    return fn


def needs_ground_truth(fn: RewardFn) -> RewardFn:
    """Declares a reward function that scores against the row's answer (``sample.ground_truth``): a run
    whose prompts lack it is refused before its first step instead of training on rewards of 0."""
    fn.megarlhf_needs_ground_truth = True
    return fn


def wants_ground_truth(fn: RewardFn) -> bool:
    return getattr(fn, "megarlhf_needs_ground_truth", False) is True


def preload(*modules: str):
    """Declares modules a reward function imports when called (e.g. a heavy parser), which a worker process
    imports before it takes calls, so that no call's time limit pays for the import."""
    def mark(fn: RewardFn) -> RewardFn:
        fn.megarlhf_preload = modules
        return fn
    return mark


def runs_in_process(fn: RewardFn) -> bool:
    return getattr(fn, "megarlhf_in_process", False) is True


@dataclass(frozen=True)
class Unscored:
    """A batch scorer's verdict that it could not score a sample (e.g. a judge's reply without a score): a
    counted failure of that sample, rewarded ``reward.failure_reward``."""

    kind: str  # a short word, e.g. "unparsed", "ambiguous", "out_of_range", "too_long"
    message: str


class BatchScorer(Protocol):
    """A slot that scores a whole batch (called on every rank, in the main thread, no timeout, because a
    Megatron model or a rollout engine runs collectives): one value per sample, a finite float or an
    :class:`Unscored` (a non-finite float counts as one too)."""

    def __call__(self, samples: Sequence[RewardInput]) -> Sequence[float | Unscored]: ...


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


