"""Runs reward functions with a per-call time limit and combines them into one weighted reward.

:class:`CombinedReward` turns a :class:`~megarlhf.rewards.api.RewardConfig` into a callable
``samples -> RewardResult``: ``reward_i = sum_f weight_f * f(sample_i) + w_rm * reward_model(samples)_i``.
Every call ``f(sample_i)`` runs on a :class:`RewardThreadPool` worker; a call that raises, returns
something other than a finite number, or runs longer than ``timeout_s`` gets ``failure_reward`` for that
term and a :class:`RewardFailure` report (batch index, truncated prompt/response, the exception), and
the other samples are scored as usual. Metrics: ``reward/mean``, ``reward/<name>/mean`` (unweighted),
``reward/failures`` (raised or invalid), ``reward/timeouts`` and ``reward/abandoned_threads``.

Why threads, not processes: rewards may be closures or user functions that do not pickle, a pool starts
in microseconds, and the rule-based checkers spend milliseconds per call. A Python thread cannot be
killed, so a timed-out call's thread is *abandoned*: it is a daemon (it never blocks interpreter exit),
a fresh worker replaces it so the pool keeps its size, and it exits by itself if the call ever returns.
``reward/abandoned_threads`` counts those still stuck. A call's clock starts when a worker picks it up,
so the wall time of one batch is at most about ``ceil(calls / num_workers) * timeout_s``.

Hand-written because ``concurrent.futures.ThreadPoolExecutor`` cannot replace a stuck worker and joins
all its threads at interpreter exit, so one hung reward would stall the pool and the process.
"""
from __future__ import annotations

import logging
import math
import numbers
import threading
import time
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Any, Callable, Sequence

from megarlhf.rewards.api import RewardConfig, RewardInput, RewardModel, resolve_reward

logger = logging.getLogger(__name__)

_SHOWN_CHARS = 200  # prompt/response characters kept in a failure report
_LOGGED_FAILURES = 5  # failures logged per batch (all are in RewardResult.failures)


def _truncate(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + f"... ({len(text)} chars)"


class _Call:
    """One reward call; its fields are written under the pool's lock."""

    def __init__(self, fn: Callable, sample: RewardInput, kwargs: dict[str, Any]):
        self.fn, self.sample, self.kwargs = fn, sample, kwargs
        self.started: float | None = None
        self.done = False
        self.abandoned = False
        self.value: Any = None
        self.error: BaseException | None = None


class RewardThreadPool:
    """A fixed number of daemon worker threads; :meth:`run` waits for a list of calls, each limited to
    ``timeout_s`` from the moment a worker starts it (see the module docstring)."""

    def __init__(self, num_workers: int):
        self._queue: SimpleQueue[_Call | None] = SimpleQueue()
        self._lock = threading.Condition()
        self._num_workers = num_workers
        self.abandoned = 0  # threads stuck in a timed-out call right now
        for _ in range(num_workers):
            self._start_worker()

    def _start_worker(self) -> None:
        threading.Thread(target=self._work, name="megarlhf-reward", daemon=True).start()

    def _work(self) -> None:
        while (call := self._queue.get()) is not None:
            with self._lock:
                call.started = time.monotonic()
                self._lock.notify_all()
            value, error = None, None
            try:
                value = call.fn(call.sample, **call.kwargs)
            except BaseException as exc:  # user code: every failure is reported, none kills the worker
                error = exc
            with self._lock:
                call.value, call.error, call.done = value, error, True
                self._lock.notify_all()
                if call.abandoned:  # a replacement worker took this thread's place
                    self.abandoned -= 1
                    return

    def run(self, calls: Sequence[_Call], timeout_s: float) -> list[bool]:
        """Runs ``calls``; returns, per call, whether it timed out (its thread is then abandoned)."""
        for call in calls:
            self._queue.put(call)
        timed_out = [False] * len(calls)
        pending = list(range(len(calls)))
        with self._lock:
            while pending:
                now, next_deadline, still = time.monotonic(), math.inf, []
                for i in pending:
                    call = calls[i]
                    if call.done:
                        continue
                    if call.started is not None and now >= call.started + timeout_s:
                        call.abandoned, timed_out[i] = True, True
                        self.abandoned += 1
                        self._start_worker()
                        continue
                    if call.started is not None:
                        next_deadline = min(next_deadline, call.started + timeout_s)
                    still.append(i)
                pending = still
                if pending:
                    # workers notify when a call starts or ends, so waiting without a limit is safe
                    self._lock.wait(None if next_deadline == math.inf else next_deadline - now)
        return timed_out

    def close(self) -> None:
        for _ in range(self._num_workers):
            self._queue.put(None)


@dataclass
class RewardFailure:
    """A reward call that raised, returned a non-number, or timed out."""

    index: int  # position of the sample in the scored batch
    name: str  # reward function name
    kind: str  # "error", "invalid" or "timeout"
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
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return None
    return f"returned {value!r} ({type(value).__name__}), expected a finite number"


class CombinedReward:
    """The run's reward: weighted registered/user functions plus the optional reward-model slot."""

    def __init__(self, config: RewardConfig, reward_model: RewardModel | None = None):
        if (reward_model is None) != (config.reward_model_path is None):
            raise ValueError("reward.reward_model_path and the reward_model slot go together: "
                             f"reward_model_path={config.reward_model_path!r}, "
                             f"reward_model={'given' if reward_model is not None else 'None'}")
        self.config = config
        self.terms = [(spec.name, spec.weight, resolve_reward(spec.name), dict(spec.kwargs))
                      for spec in config.functions]
        self.reward_model = reward_model
        self.pool = RewardThreadPool(config.num_workers)

    def __call__(self, samples: Sequence[RewardInput]) -> RewardResult:
        samples = list(samples)
        calls = [[_Call(fn, sample, kwargs) for sample in samples] for _, _, fn, kwargs in self.terms]
        timed_out = self.pool.run([c for row in calls for c in row], self.config.timeout_s)
        components, failures = {}, []
        for t, (name, _, _, _) in enumerate(self.terms):
            values = []
            for i, call in enumerate(calls[t]):
                failure = self._failure(name, i, call, timed_out[t * len(samples) + i])
                if failure is not None:
                    failures.append(failure)
                values.append(self.config.failure_reward if failure else float(call.value))
            components[name] = values
        weights = {name: weight for name, weight, _, _ in self.terms}
        if self.reward_model is not None:
            components["reward_model"] = self._score_with_model(samples)
            weights["reward_model"] = self.config.reward_model_weight
        rewards = [sum(weights[name] * components[name][i] for name in components) for i in range(len(samples))]
        for failure in failures[:_LOGGED_FAILURES]:
            logger.warning("%s", failure)
        return RewardResult(rewards, components, failures, self._metrics(rewards, components, failures))

    def _failure(self, name: str, index: int, call: _Call, timed_out: bool) -> RewardFailure | None:
        if timed_out:
            kind, message = "timeout", f"no result after {self.config.timeout_s} s"
        elif call.error is not None:
            kind, message = "error", f"{type(call.error).__name__}: {call.error}"
        elif (problem := _check_value(call.value)) is not None:
            kind, message = "invalid", problem
        else:
            return None
        return RewardFailure(index, name, kind, message, _truncate(call.sample.prompt),
                             _truncate(call.sample.response))

    def _score_with_model(self, samples: list[RewardInput]) -> list[float]:
        scores = list(self.reward_model(samples))
        if len(scores) != len(samples):
            raise ValueError(f"the reward model returned {len(scores)} scores for {len(samples)} samples")
        bad = [i for i, s in enumerate(scores) if _check_value(s) is not None]
        if bad:
            raise ValueError(f"the reward model returned non-finite scores at samples {bad[:10]}")
        return [float(s) for s in scores]

    def _metrics(self, rewards, components, failures) -> dict[str, float]:
        n = max(len(rewards), 1)
        metrics = {"reward/mean": sum(rewards) / n,
                   "reward/failures": float(sum(f.kind != "timeout" for f in failures)),
                   "reward/timeouts": float(sum(f.kind == "timeout" for f in failures)),
                   "reward/abandoned_threads": float(self.pool.abandoned)}
        for name, values in components.items():
            metrics[f"reward/{name}/mean"] = sum(values) / n
        return metrics

    def close(self) -> None:
        """Stops the idle workers (abandoned ones exit when their call returns)."""
        self.pool.close()
