"""The fake backend (``rollout.backend: fake``): deterministic responses at the cost of one forward pass.

Tests of the loops need rollouts that are cheap, reproducible whatever the weights, and still honest about
the policy: :class:`FakeEngine` draws each sample's tokens from its own seed alone (``torch.Generator(seed
+ i * n + j)``: a length in ``[1, limit]``, uniform token ids, the smallest stop id at the end when the
length falls short of the limit) and reports the log-prob of every sampled token under the weights it
holds, as the contract defines it (``log_softmax(logits / T)``, one teacher-forced forward per batch). So
the weight sync, its probe and the step-0 gate check it as they check a real engine, while the samples do
not change as the policy trains. Weights, fingerprints, sleep and wake-up are the transformers engine's.
"""
from __future__ import annotations

import torch

from megarlhf.rollout.engines.api import ENGINES, EngineSpec
from megarlhf.rollout.engines.hf import HFEngine
from megarlhf.rollout.engines.sampling import RolloutBatch, SamplingConfig

_BASE_SEED = 0x5EED  # the seed of sample 0 of prompt 0 when a call gives none


class FakeEngine(HFEngine):
    """Seeded token draws, scored by the held weights (module docstring)."""

    @classmethod
    def from_config(cls, hf_dir, config, device) -> "FakeEngine":
        if config.routing_layers:
            raise ValueError("rollout.backend='fake' records no MoE routing: routing replay r3 needs 'hf' or 'vllm'")
        return super().from_config(hf_dir, config, device)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        sampling.validate(len(prompts))
        self._check_prompts(prompts)
        self._abort.clear()
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self.eos_ids)
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
