"""The fake backend (``rollout.backend: fake``): deterministic responses at the cost of one forward pass.

Tests of the loops need rollouts that are cheap, reproducible whatever the weights, and still honest about
the policy: :class:`FakeEngine` draws each sample's tokens from its own seed alone (``torch.Generator(seed
+ i * n + j)``: a length in ``[1, limit]``, uniform token ids, the smallest stop id at the end when the
length falls short of the limit) and reports the log-prob of every sampled token under the weights it
holds, as the contract defines it (``log_softmax(logits / T)``, one teacher-forced forward per batch). So
the weight sync, its probe and the step-0 gate check it as they check a real engine, while the samples do
not change as the policy trains. Weights, fingerprints, sleep and wake-up are the transformers engine's.

Streamed samples (:mod:`megarlhf.rollout.engines.streaming`) are drawn the same way when submitted (an
unseeded one from the next of a counter's seeds) and come out in the order a continuously batching engine
would finish them: each :meth:`FakeEngine.advance` moves every sample in flight by as many tokens as the
shortest of them still needs, and scores the tokens of those that finished. As with vLLM, nothing else may
use the engine while samples are in flight (a load is refused).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import torch

from megarlhf.rollout.engines.api import ENGINES, EngineSpec
from megarlhf.rollout.engines.hf import HFEngine
from megarlhf.rollout.engines.sampling import RolloutBatch, SamplingConfig
from megarlhf.rollout.engines.streaming import SampleOutput, SampleRequest

_BASE_SEED = 0x5EED  # the seed of sample 0 of prompt 0 when a call gives none


@dataclass
class _Streamed:
    """A streamed sample in flight: all its tokens, drawn at submission, and how many were generated so far."""

    key: Hashable
    prompt: list[int]
    tokens: list[int]
    finish: str
    temperature: float
    generated: int = 0
    logprobs: list[float] = field(default_factory=list)  # of the first len(logprobs) tokens

    def output(self, finish: str) -> SampleOutput:
        return SampleOutput(self.key, self.tokens[:self.generated], self.logprobs, finish)


class FakeEngine(HFEngine):
    """Seeded token draws, scored by the held weights (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._streamed: list[_Streamed] = []  # the streamed samples in flight
        self._unseeded = 0  # unseeded streamed samples so far (each draws from a seed of its own)

    @classmethod
    def from_config(cls, hf_dir, config, device) -> "FakeEngine":
        if config.routing_layers:
            raise ValueError("rollout.backend='fake' records no MoE routing: routing replay r3 needs 'hf' or 'vllm'")
        return super().from_config(hf_dir, config, device)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        sampling.validate(len(prompts))
        self._check_prompts(prompts)
        self._idle("generate")
        self._abort.clear()
        stop_ids = self._stop_ids(sampling)
        rows = []  # (prompt index, response ids, finish reason)
        for i, prompt in enumerate(prompts):
            seed = sampling.prompt_seed(i)
            seed = _BASE_SEED + i * sampling.n if seed is None else seed
            limit = min(sampling.max_new_tokens, self.max_model_len - len(prompt))
            for j in range(sampling.n):
                if self._abort.is_set():
                    rows.append((i, [], "abort"))
                else:
                    rows.append((i, *self._draw(seed + j, limit, stop_ids)))
        scored = iter(self.teacher_forced([list(prompts[i]) + ids for i, ids, _ in rows if ids],
                                          sampling.temperature or 1.0))
        batch = RolloutBatch()
        for i, ids, reason in rows:
            logprobs = next(scored)[len(prompts[i]) - 1:] if ids else []
            batch.prompt_index.append(i)
            batch.prompt_ids.append(list(map(int, prompts[i])))
            batch.response_ids.append(ids)
            batch.logprobs.append(logprobs)
            batch.finish_reasons.append(reason)
        return batch

    def _stop_ids(self, sampling: SamplingConfig) -> set[int]:
        return set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self.eos_ids)

    # ---- streaming (module docstring) -----------------------------------------------------------------
    def submit(self, requests: list[SampleRequest], sampling: SamplingConfig) -> None:
        self._check_prompts([list(r.prompt_ids) for r in requests])
        stop_ids = self._stop_ids(sampling)
        for r in requests:
            limit = min(r.max_new_tokens, self.max_model_len - len(r.prompt_ids))
            seed = r.seed
            if seed is None:
                seed, self._unseeded = _BASE_SEED + 2**20 + self._unseeded, self._unseeded + 1
            self._streamed.append(_Streamed(r.key, list(r.prompt_ids), *self._draw(seed, limit, stop_ids),
                                      sampling.temperature or 1.0))

    def advance(self) -> list[SampleOutput]:
        streamed = self._streamed
        if not streamed:
            return []
        steps = min(len(s.tokens) - s.generated for s in streamed)
        for s in streamed:
            s.generated += steps
        done = [s for s in streamed if s.generated == len(s.tokens)]
        self._score(done)
        self._streamed = [s for s in streamed if s.generated < len(s.tokens)]
        return [s.output(s.finish) for s in done]

    def interrupt(self) -> list[SampleOutput]:
        streamed, self._streamed = self._streamed, []
        self._score(streamed)
        return [s.output("abort") for s in streamed]

    def in_flight(self) -> int:
        return len(self._streamed)

    def begin_load(self) -> None:
        self._idle("begin_load")
        super().begin_load()

    def _score(self, streamed: list[_Streamed]) -> None:
        """The log-probs of the generated tokens not yet scored, under the weights held."""
        todo = [s for s in streamed if len(s.logprobs) < s.generated]
        for temperature in {s.temperature for s in todo}:
            group = [s for s in todo if s.temperature == temperature]
            scored = self.teacher_forced([s.prompt + s.tokens[:s.generated] for s in group], temperature)
            for s, logprobs in zip(group, scored):
                s.logprobs += logprobs[len(s.prompt) - 1 + len(s.logprobs):]

    def _draw(self, seed: int, limit: int, stop_ids: set[int]) -> tuple[list[int], str]:
        """One sample's tokens and finish reason, from its seed alone."""
        generator = torch.Generator().manual_seed(seed)
        length = int(torch.randint(1, limit + 1, (), generator=generator))  # host: a CPU generator
        ids = torch.randint(0, self.vocab_size, (length,), generator=generator).tolist()  # host: as above
        for k, token in enumerate(ids):
            while token in stop_ids:  # a stop id only at the end
                token = (token + 1) % self.vocab_size
            ids[k] = token
        if length < limit and stop_ids:
            ids[-1] = min(stop_ids)
            return ids, "stop"
        return ids, "length"


ENGINES.register("fake")(EngineSpec(build=FakeEngine.from_config))
