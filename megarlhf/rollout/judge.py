"""The LLM judge of ``reward.judge``: a rollout engine of its own that reads each sample and writes its score.

:class:`EngineJudge` fills the judge's :class:`~megarlhf.rewards.api.BatchScorer` slot of
:class:`~megarlhf.rewards.runner.CombinedReward`. Each trainer rank holds one judge engine (``judge.backend``,
default ``rollout.backend``, tensor-parallel size 1, built from ``judge.model_path`` with
``EngineConfig.in_process=False``, so a vLLM judge runs in a child process of its own beside the policy's
engine). The ranks of one model replica score the same samples, so each judges a contiguous share and the
replica all-gathers the verdicts, as the rollout phase shares generation. Where the engine can sleep (on a GPU)
it sleeps between steps and wakes only to judge.

A sample's judge prompt (:class:`megarlhf.rewards.judging.JudgePrompts`) that leaves no room for
``judge.max_new_tokens`` within ``judge.max_model_len`` is not generated: it is an ``Unscored("too_long")``; nor
is one whose quoted values became the judge's added tokens (``Unscored("injected")``).
Replies are parsed by :func:`megarlhf.rewards.judging.parse_score`. Each judge prompt samples with a seed drawn
from the run seed and its own tokens, so which sample draws which random numbers does not depend on the
batch, the layout or a resume (the engine's arithmetic may still differ in the last bits across batch sizes).
An engine that fails on one rank fails the call on every rank of the replica, after the gather, naming the rank,
rather than leaving the others waiting in it.
"""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import Sequence

import torch

from megarlhf.config.schema import RunConfig
from megarlhf.core.errors import ConfigError
from megarlhf.rewards.api import RewardInput, Unscored
from megarlhf.rewards.judging import JudgePrompts, judge_fields, parse_score
from megarlhf.rollout.engines import EngineConfig, RolloutEngine, SamplingConfig, build_engine
from megarlhf.rollout.engines.api import TAGS
from parallel.runtime import Runtime


def judge_engine_config(config: RunConfig) -> EngineConfig:
    judge = config.reward.judge
    return EngineConfig(backend=judge.backend or config.rollout.backend, tensor_parallel_size=1,
                        dtype=judge.dtype or config.model.dtype, seed=config.seed,
                        enforce_eager=config.rollout.enforce_eager, max_model_len=judge.max_model_len,
                        kv_cache_bytes=judge.kv_cache_mb * 2**20, temperature=judge.temperature,
                        num_threads=torch.get_num_threads(), in_process=False)


def load_judge_tokenizer(model_path: str):
    """The judge's tokenizer; raises naming ``reward.judge.model_path`` unless it is an HF model directory."""
    from transformers import AutoTokenizer

    if not (Path(model_path) / "config.json").is_file():
        raise ConfigError(f"reward.judge.model_path={model_path!r} is not an HF model directory (no config.json)")
    return AutoTokenizer.from_pretrained(model_path)


class JudgeError(str):
    """What a rank's judging raised, as it travels to the replica's other ranks."""


class EngineJudge:
    """The judge slot: ``samples -> scores in [0, 1] or Unscored`` (module docstring)."""

    def __init__(self, config: RunConfig, runtime: Runtime, tokenizer, engine: RolloutEngine):
        self.judge, self.seed, self.runtime = config.reward.judge, config.seed, runtime
        self.tokenizer, self.engine = tokenizer, engine
        self.prompts = JudgePrompts(self.judge, tokenizer)
        self.stop_ids = () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
        if self.engine.sleep_supported:
            self.engine.sleep()

    @classmethod
    def build(cls, config: RunConfig, runtime: Runtime) -> "EngineJudge":
        tokenizer = load_judge_tokenizer(config.reward.judge.model_path)
        engine = build_engine(config.reward.judge.model_path, judge_engine_config(config), runtime.device)
        return cls(config, runtime, tokenizer, engine)

    def __call__(self, samples: Sequence[RewardInput]) -> list[float | Unscored]:
        samples = list(samples)
        replica = self.runtime.replica
        share = torch.arange(len(samples), device="cpu").tensor_split(replica.size)[replica.rank]  # host: indices
        try:
            mine = self.judge_all([samples[i] for i in share.tolist()])
        except Exception as error:  # every rank reaches the gather, then every rank raises
            mine = JudgeError(f"rank {replica.rank} of the replica: {type(error).__name__}: {error}")
        parts = self.runtime.all_gather_objects(mine, over="replica")
        failed = [part for part in parts if isinstance(part, JudgeError)]
        if failed:
            raise RuntimeError(f"the judge ({self.judge.model_path}) failed: {failed[0]}")
        return [verdict for part in parts for verdict in part]

    def judge_all(self, samples: list[RewardInput]) -> list[float | Unscored]:
        """This rank's verdicts on ``samples``, in batches of ``judge.batch_size`` prompts."""
        prompts = [self.prompts.ids(judge_fields(s)) for s in samples]
        room = self.judge.max_model_len - self.judge.max_new_tokens
        verdicts: list[float | Unscored] = [
            p if isinstance(p, Unscored) else
            Unscored("too_long", f"the judge prompt has {len(p)} tokens; judge.max_model_len="
                                 f"{self.judge.max_model_len} leaves room for {room} with judge.max_new_tokens="
                                 f"{self.judge.max_new_tokens}") for p in prompts]
        fitting = [i for i, p in enumerate(prompts) if not isinstance(p, Unscored) and len(p) <= room]
        if not fitting:
            return verdicts
        if self.engine.sleep_supported:
            self.engine.wake_up(list(TAGS))
        try:
            for start in range(0, len(fitting), self.judge.batch_size):
                chunk = fitting[start:start + self.judge.batch_size]
                for i, (reply, cut) in zip(chunk, self._replies([prompts[i] for i in chunk])):
                    verdicts[i] = parse_score(reply, self.judge, cut)
        finally:
            if self.engine.sleep_supported:
                self.engine.sleep()
        return verdicts

    def _replies(self, prompts: list[list[int]]) -> list[tuple[str, bool]]:
        """The judge's reply to each prompt (``answer_prefix`` + what it generated, special tokens dropped) and
        whether the token limit cut it."""
        seeds = tuple(zlib.crc32(f"{self.seed}:{p}".encode()) for p in prompts)  # the prompt's own seed
        sampling = SamplingConfig(n=1, temperature=self.judge.temperature, max_new_tokens=self.judge.max_new_tokens,
                                  stop_token_ids=self.stop_ids, prompt_seeds=seeds)
        batch = self.engine.generate(prompts, sampling)
        replies = [("", False)] * len(prompts)
        for p, response, reason in zip(batch.prompt_index, batch.response_ids, batch.finish_reasons):
            text = self.judge.answer_prefix + self.tokenizer.decode(response, skip_special_tokens=True)
            replies[p] = (text, reason == "length")
        return replies

    def close(self) -> None:
        self.engine.close()
