"""Runs reward functions with a per-call time limit and combines them into one weighted reward.

:class:`CombinedReward` turns a :class:`~megarlhf.config.reward.RewardConfig` into a callable
``samples -> RewardResult``: ``reward_i = sum_f weight_f * f(sample_i) + sum_s weight_s * s(samples)_i`` over the
functions ``f`` and the batch scorers ``s`` (a learned reward model, an LLM judge: :class:`BatchScorer`).
Every call ``f(sample_i)`` runs in a worker process of a :class:`~megarlhf.isolation.process_pool.TimedProcessPool`
(killed and replaced past ``timeout_s``), or, for a function declared
:func:`~megarlhf.rewards.api.in_process`, on a thread; a call that raises, returns
something other than a finite number, or runs longer than ``timeout_s`` gets ``failure_reward`` for that
term and a :class:`RewardFailure` report (batch index, truncated prompt/response, the exception), and
the other samples are scored as usual; a batch scorer's non-finite or :class:`Unscored` value is a failure of
that sample in the same way. Metrics: ``reward/mean``, ``reward/<name>/mean`` (unweighted),
``reward/failures`` (raised, invalid or unscored), ``reward/<name>/failures`` (all kinds, per term),
``reward/timeouts``, ``reward/killed_workers`` (worker processes
killed or found dead since the start) and ``reward/abandoned_threads`` (threads of in-process functions
still stuck in a timed-out call: :class:`megarlhf.isolation.timed_calls.TimedThreadPool`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from megarlhf.core.errors import ConfigError
from megarlhf.isolation.process_pool import TimedProcessPool
from megarlhf.config.reward import RewardConfig
from megarlhf.rewards.api import BatchScorer, RewardInput, Unscored, resolve_reward, runs_in_process
from megarlhf.isolation.timed_calls import TimedCall, TimedThreadPool, is_finite_number, shown

logger = logging.getLogger(__name__)

_SHOWN_CHARS = 200  # prompt/response characters kept in a failure report
_LOGGED_FAILURES = 5  # failures logged per batch (all are in RewardResult.failures)


def _truncate(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + f"... ({len(text)} chars)"


@dataclass
class RewardFailure:
    """A reward call that raised, returned a non-number, or timed out."""

    index: int  # position of the sample in the scored batch
    name: str  # reward function name
    kind: str  # "error", "invalid", "timeout", or a batch scorer's Unscored.kind
    message: str
    prompt: str  # truncated
    response: str  # truncated

    def __str__(self) -> str:
        return (f"reward {self.name!r} {self.kind} on sample {self.index}: {self.message} "
                f"(prompt {self.prompt!r}, response {self.response!r})")


@dataclass
class RewardResult:
    rewards: list[float]  # the weighted sum per sample
    components: dict[str, list[float]]  # unweighted value of each term per sample
    failures: list[RewardFailure] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def _check_value(value: Any) -> str | None:
    """None if ``value`` is a usable reward, else why not."""
    if is_finite_number(value):
        return None
    return f"returned {shown(value)} ({type(value).__name__}), expected a finite number"


class CombinedReward:
    """The run's reward: weighted registered/user functions plus the optional batch scorers (the learned reward
    model of ``reward.reward_model_path``, the judge of ``reward.judge``), each given iff its setting is set."""

    def __init__(self, config: RewardConfig, reward_model: BatchScorer | None = None,
                 judge: BatchScorer | None = None):
        for key, scorer, setting in (("reward_model_path", reward_model, config.reward_model_path),
                                     ("judge", judge, config.judge)):
            if (scorer is None) != (setting is None):
                raise ConfigError(f"reward.{key} and its scorer go together: reward.{key} is "
                                  f"{'set' if setting is not None else 'unset'}, the scorer "
                                  f"{'given' if scorer is not None else 'None'}")
        self.config = config
        self.terms = [(spec.name, spec.weight, resolve_reward(spec.name), dict(spec.kwargs))
                      for spec in config.functions]
        self.scorers = [(name, weight, scorer) for name, weight, scorer in
                        (("reward_model", config.reward_model_weight, reward_model),
                         ("judge", config.judge.weight if config.judge else 0.0, judge)) if scorer is not None]
        self.pool = TimedThreadPool(config.num_workers)
        self.processes = TimedProcessPool(config.num_workers, "megarlhf.rewards.api:resolve_reward",
                                          [name for name, _, fn, _ in self.terms if not runs_in_process(fn)],
                                          memory_mb=config.worker_memory_mb)

    def __call__(self, samples: Sequence[RewardInput]) -> RewardResult:
        samples = list(samples)
        # a function declared in_process runs on a thread; any other runs in a worker process by its name
        threaded = [runs_in_process(fn) for _, _, fn, _ in self.terms]
        calls = [[TimedCall(fn if thread else name, sample, kwargs) for sample in samples]
                 for (name, _, fn, kwargs), thread in zip(self.terms, threaded)]
        timed_out = {}
        for pool, thread in ((self.pool, True), (self.processes, False)):
            batch = [call for row, in_thread in zip(calls, threaded) if in_thread == thread for call in row]
            timed_out.update(zip(map(id, batch), pool.run(batch, self.config.timeout_s)))
        components, failures = {}, []
        for name, row in zip((term[0] for term in self.terms), calls):
            values = []
            for i, call in enumerate(row):
                failure = self._failure(name, i, call, timed_out[id(call)])
                if failure is not None:
                    failures.append(failure)
                values.append(self.config.failure_reward if failure else float(call.value))
            components[name] = values
        weights = {name: weight for name, weight, _, _ in self.terms}
        for name, weight, scorer in self.scorers:
            components[name] = self._score_batch(name, scorer, samples, failures)
            weights[name] = weight
        rewards = [sum(weights[name] * components[name][i] for name in components) for i in range(len(samples))]
        for failure in failures[:_LOGGED_FAILURES]:
            logger.warning("%s", failure)
        return RewardResult(rewards, components, failures, self._metrics(rewards, components, failures))

    def _failure(self, name: str, index: int, call: TimedCall, timed_out: bool) -> RewardFailure | None:
        if timed_out:
            kind, message = "timeout", f"no result after {self.config.timeout_s} s"
        elif call.error is not None:
            kind, message = "error", f"{type(call.error).__name__}: {call.error}"
        elif (problem := _check_value(call.value)) is not None:
            kind, message = "invalid", problem
        else:
            return None
        return RewardFailure(index, name, kind, message, _truncate(call.item.prompt),
                             _truncate(call.item.response))

    def _score_batch(self, name: str, scorer: BatchScorer, samples: list[RewardInput],
                     failures: list[RewardFailure]) -> list[float]:
        """A batch scorer's scores; an :class:`Unscored` or non-finite one (a judge's reply without a score, a
        model that overflowed on one sample) is a failure of that sample, scored ``failure_reward`` and reported,
        as a function's would be."""
        scores = list(scorer(samples))
        if len(scores) != len(samples):
            raise ValueError(f"the {name} returned {len(scores)} scores for {len(samples)} samples")
        values = []
        for i, (sample, score) in enumerate(zip(samples, scores)):
            if isinstance(score, Unscored):
                kind, problem = score.kind, score.message
            else:
                kind, problem = "invalid", _check_value(score)
            if problem is not None:
                failures.append(RewardFailure(i, name, kind, problem, _truncate(sample.prompt),
                                              _truncate(sample.response)))
            values.append(self.config.failure_reward if problem is not None else float(score))
        return values

    def _metrics(self, rewards, components, failures) -> dict[str, float]:
        n = max(len(rewards), 1)
        metrics = {"reward/mean": sum(rewards) / n,
                   "reward/failures": float(sum(f.kind != "timeout" for f in failures)),
                   "reward/timeouts": float(sum(f.kind == "timeout" for f in failures)),
                   "reward/abandoned_threads": float(self.pool.abandoned),
                   "reward/killed_workers": float(self.processes.killed)}
        for name, values in components.items():
            metrics[f"reward/{name}/mean"] = sum(values) / n
            metrics[f"reward/{name}/failures"] = float(sum(f.name == name for f in failures))
        return metrics

    def close(self) -> None:
        """Stops the workers (abandoned threads exit when their call returns) and the batch scorers that hold
        something beyond memory (a judge's engine)."""
        self.pool.close()
        self.processes.close()
        for _, _, scorer in self.scorers:
            close = getattr(scorer, "close", None)
            if close is not None:
                close()
