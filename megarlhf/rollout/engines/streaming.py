"""Streaming generation, the engine side: samples go in one by one and come out as each finishes.

Batch generation (:meth:`~megarlhf.rollout.engines.api.RolloutEngine.generate`) returns when the longest
sample of the batch is done, so a long tail stalls everything behind it. A streaming caller instead keeps
samples in flight: :meth:`~megarlhf.rollout.engines.api.RolloutEngine.submit` adds
:class:`SampleRequest`\\ s to the generation under way, :meth:`~megarlhf.rollout.engines.api.RolloutEngine.advance`
generates until at least one of them finished and returns those (:class:`SampleOutput`), and
:meth:`~megarlhf.rollout.engines.api.RolloutEngine.interrupt` stops the rest, returning the tokens each has
so far (a partial rollout: its caller may submit the prompt plus those tokens again, for example after new
weights were loaded).

A sample is one request (n = 1) with its own seed and token limit, so a resubmitted one (a longer prompt, a
smaller limit) and a fresh one share the engine. What it is sampled with is the ``sampling`` passed to
``submit``: temperature, stop tokens, ``ignore_eos``; its ``n``, seeds and ``max_new_tokens`` are the
requests'. Log-probs follow the generation contract (``log softmax(logits / T)``). A resubmitted sample
restarts its seed's random stream: give it a seed of its own.

While samples are in flight the engine does nothing else: new weights reach them by interrupting them,
loading, and submitting each again as prompt + tokens so far (every token then keeps the log-prob, and the
caller the policy version, it was sampled with). Calls are made from one thread.

:class:`BatchStream` is the contract's default for a backend that only generates in batches: ``advance``
generates everything submitted, one batch per sampling and token limit, and returns it all, so nothing is
ever interrupted half-way. Backends that batch continuously (vLLM, the fake engine) override ``submit``,
``advance``, ``interrupt`` and ``in_flight``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Hashable

from megarlhf.rollout.engines.sampling import SamplingConfig


@dataclass(frozen=True)
class SampleRequest:
    """One sample to generate: ``key`` is the caller's name for it (returned with its output)."""

    key: Hashable
    prompt_ids: tuple[int, ...]  # what the sample is conditioned on (a resubmission: prompt + tokens so far)
    max_new_tokens: int
    seed: int | None = None  # None: unseeded

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError(f"SampleRequest {self.key!r}: empty prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"SampleRequest {self.key!r}: max_new_tokens={self.max_new_tokens} (must be >= 1)")


@dataclass
class SampleOutput:
    """A sample that finished, or was interrupted (``finish_reason`` "abort", the tokens generated so far)."""

    key: Hashable
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    routed_experts: object = None  # an engine recording routing (replay r3): the sample's record


def request_sampling(sampling: SamplingConfig, requests: list[SampleRequest]) -> SamplingConfig:
    """``sampling`` for a batch of ``requests`` sharing one token limit: one sample per prompt, each with its
    request's seed (all seeded or none)."""
    seeds = [r.seed for r in requests]
    if len({r.max_new_tokens for r in requests}) > 1:
        raise ValueError("request_sampling: the requests' max_new_tokens differ")
    if None in seeds and any(s is not None for s in seeds):
        raise ValueError("streamed samples: some requests are seeded, some not")
    return replace(sampling, n=1, seed=None, prompt_seeds=None if None in seeds else tuple(seeds),
                   max_new_tokens=requests[0].max_new_tokens)


class BatchStream:
    """The streaming contract over batch generation (module docstring); one per engine."""

    def __init__(self, engine):
        self.engine = engine
        self.pending: list[tuple[SampleRequest, SamplingConfig]] = []

    def submit(self, requests: list[SampleRequest], sampling: SamplingConfig) -> None:
        seeded = {r.seed is not None for r, _ in self.pending} | {r.seed is not None for r in requests}
        if len(seeded) > 1:
            raise ValueError(f"streamed samples: some are seeded, some not ({[r.key for r in requests][:5]} ...); "
                             "seed all of them or none")
        self.pending += [(r, sampling) for r in requests]

    def advance(self) -> list[SampleOutput]:
        """Everything submitted, generated as batches of the requests that share a sampling and a limit (a failure
        leaves every request pending)."""
        batches: dict[tuple, list[SampleRequest]] = {}
        for request, sampling in self.pending:
            batches.setdefault((sampling, request.max_new_tokens), []).append(request)
        out = []
        for (sampling, _), requests in batches.items():
            batch = self.engine.generate([list(r.prompt_ids) for r in requests], request_sampling(sampling, requests))
            routing = batch.routed_experts or [None] * len(requests)
            out += [SampleOutput(requests[i].key, ids, logprobs, finish, record) for i, ids, logprobs, finish, record
                    in zip(batch.prompt_index, batch.response_ids, batch.logprobs, batch.finish_reasons, routing)]
        self.pending = []
        return out

    def interrupt(self) -> list[SampleOutput]:
        """Nothing is half-generated between two ``advance`` calls: the requests not yet generated come back
        with no tokens."""
        out = [SampleOutput(request.key, [], [], "abort") for request, _ in self.pending]
        self.pending = []
        return out

    def in_flight(self) -> int:
        return len(self.pending)
