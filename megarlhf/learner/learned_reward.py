"""A learned reward in the RL loop: a value-head reward model scoring each sampled response.

:class:`LearnedReward` fills the reward model's :class:`megarlhf.rewards.api.BatchScorer` slot of
:class:`~megarlhf.rewards.runner.CombinedReward`. It scores the tokens the policy saw and produced
(``RewardInput.prompt_ids`` + ``response_ids``, so the recipe's chat template is in them exactly as the
policy was prompted) with a frozen value-head model built from ``reward.reward_model_path`` on the
training ranks (:func:`megarlhf.learner.build_reward_model`; colocated and offloaded around rollouts
like the reference model): the score is the head's output at the response's last token, as the reward
model was trained (:mod:`megarlhf.learner.preference`). Optionally the score is standardised with the
mean / std stored beside the model by ``megarlhf rm`` (``reward.reward_model_normalize``) and clipped
(``reward.reward_model_clip``). Every rank calls it together (the forward is collective over the model-
parallel group). It lives in ``training``, not ``rewards``, because it runs a Megatron model; ``rewards``
defines only the slot it fills.

:func:`check_reward_model` refuses, before anything is built, a reward model whose tokenizer is not the
policy's (its scores would read other tokens); building the model refuses one without a reward head.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from megarlhf.core.errors import ConfigError
from megarlhf.config.reward import RewardConfig
from megarlhf.rewards.api import RewardInput
from megarlhf.learner.batch import ExperienceBatch
from megarlhf.learner.preference import compute_scores

STATS_FILE = "megarlhf_reward_stats.json"


def check_reward_model(path: str, policy_tokenizer) -> None:
    """Raises naming ``path`` unless it is an HF directory whose vocabulary is the policy tokenizer's
    (:func:`megarlhf.learner.build_reward_model` then refuses one without a reward head)."""
    from transformers import AutoTokenizer

    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"reward.reward_model_path={path!r} is not an HF model directory (no config.json)")
    theirs, ours = AutoTokenizer.from_pretrained(path).get_vocab(), policy_tokenizer.get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
        raise ConfigError(f"reward.reward_model_path={path!r}: its vocabulary differs from the policy's "
                          f"({len(theirs)} vs {len(ours)} tokens; e.g. {differ}): it would score other tokens")


class LearnedReward:
    """The reward-model slot: ``samples -> scores`` (see the module docstring)."""

    def __init__(self, model, config, reward: RewardConfig):
        self.model, self.config, self.reward = model, config, reward
        self.mean, self.std = 0.0, 1.0
        if reward.reward_model_normalize:
            stats_path = Path(reward.reward_model_path) / STATS_FILE
            if not stats_path.is_file():
                raise FileNotFoundError(f"reward.reward_model_normalize needs {stats_path} (written by `megarlhf rm`)")
            stats = json.loads(stats_path.read_text())
            self.mean, self.std = float(stats["mean"]), max(float(stats["std"]), 1e-6)

    def __call__(self, samples: Sequence[RewardInput]) -> list[float]:
        if not samples:
            return []
        empty = [i for i, s in enumerate(samples) if not s.response_ids or not s.prompt_ids]
        if empty:
            raise ValueError(f"the reward model needs the samples' token ids; samples {empty[:5]} have none")
        batch = ExperienceBatch.from_sequences([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                               device=self.model.runtime.device)
        scores = (compute_scores(self.model, batch, self.config) - self.mean) / self.std
        clip = self.reward.reward_model_clip
        if clip is not None:
            scores = scores.clamp(-clip, clip)
        return scores.tolist()
