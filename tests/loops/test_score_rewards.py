"""score_rewards on multi-turn episodes: verifiers read the model's own turns (a tool's observation is not
the model's answer), and environment rewards count in training but not in evaluation scores."""
from __future__ import annotations

import pytest

from megarlhf.config import RunConfig, load_config
from megarlhf.data.prompts import PromptExample
from megarlhf.rewards import CombinedReward
from megarlhf.rewards.api import in_process
from megarlhf.rollout.engines.sampling import RolloutBatch
from megarlhf.loops.rewarding import score_rewards
from model_providers.tiny_models import train_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_tokenizer()


def _episode(tokenizer, turns: list[tuple[str, int]], env_reward: float) -> RolloutBatch:
    """One sample whose response is ``turns`` (text, 1 for the model's tokens / 0 for an observation)."""
    ids, mask = [], []
    for text, own in turns:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        mask += [own] * len(piece)
    return RolloutBatch(prompt_index=[0], prompt_ids=[[1, 2]], response_ids=[ids], logprobs=[[0.0] * len(ids)],
                        finish_reasons=["length"], loss_masks=[mask], env_rewards=[env_reward], tool_calls=[1])


def test_verifiers_read_the_models_turns_and_evaluation_leaves_env_rewards_out(tokenizer):
    config = load_config(RunConfig, None, ["model.path=unused", "data.train_path=unused.jsonl", "reward.functions=[{name: exact_match}]"])
    reward = CombinedReward(config.reward)
    examples = [PromptExample(0, "What is 2 + 3?", [1, 2], "5", {})]
    # the model never answered; the tool's observation holds an answer-shaped sentence
    looked_up = _episode(tokenizer, [("Let me look it up.", 1), (" The answer is 5.", 0)], env_reward=0.25)
    assert score_rewards(reward, examples, looked_up, tokenizer, config)[0] == [0.25]  # env reward only
    assert score_rewards(reward, examples, looked_up, tokenizer, config, training=False)[0] == [0.0]
    answered = _episode(tokenizer, [("Let me add.", 1), (" 5", 0), (" The answer is 5.", 1)], env_reward=0.25)
    assert score_rewards(reward, examples, answered, tokenizer, config)[0] == [1.25]
    assert score_rewards(reward, examples, answered, tokenizer, config, training=False)[0] == [1.0]


@in_process  # records into this process
def in_process_seen_turns(sample) -> float:
    """Records what a reward function is given (the test reads it back)."""
    SEEN.append((sample.response, sample.turns))
    return 0.0


SEEN: list = []


def test_a_reward_gets_the_models_turns_one_by_one_and_joined(tokenizer):
    config = load_config(RunConfig, None, ["model.path=unused", "data.train_path=unused.jsonl",
                                           f"reward.functions=[{{name: '{__name__}:in_process_seen_turns'}}]"])
    examples = [PromptExample(0, "What is 2 + 3?", [1, 2], "5", {})]
    SEEN.clear()
    episode = _episode(tokenizer, [("Let me add. ", 1), (" 5", 0), (" The answer is 5.", 1)], env_reward=0.0)
    score_rewards(CombinedReward(config.reward), examples, episode, tokenizer, config)
    assert SEEN == [("Let me add.\nThe answer is 5.", ("Let me add.", "The answer is 5."))]
    single = RolloutBatch(prompt_index=[0], prompt_ids=[[1, 2]], response_ids=[tokenizer.encode("The answer is 5.")],
                          logprobs=[[0.0]], finish_reasons=["stop"])
    SEEN.clear()
    score_rewards(CombinedReward(config.reward), examples, single, tokenizer, config)
    assert SEEN == [("The answer is 5.", ())]


def test_a_step_whose_every_reward_failed_stops_with_a_clear_error_and_one_that_partly_failed_goes_on(tokenizer):
    """A reward model that returns NaN: a sample whose score is not finite is a counted failure (scored
    reward.failure_reward, skipped by rs / online-dpo); a step where every sample failed stops the run."""
    from types import SimpleNamespace

    from megarlhf.core.errors import RewardsFailedError
    from megarlhf.loops.collect import score_round

    config = load_config(RunConfig, None, ["model.path=unused", "data.train_path=unused.jsonl",
                                           "reward.functions=[]", "reward.reward_model_path=/rm"])
    examples = [PromptExample(0, "What is 2 + 3?", [1, 2], "5", {})]
    rollout = RolloutBatch(prompt_index=[0, 0], prompt_ids=[[1, 2]] * 2, response_ids=[[5], [6]],
                           logprobs=[[0.0]] * 2, finish_reasons=["stop"] * 2)
    runtime = SimpleNamespace(all_reduce=lambda values, op="sum": values, dp=SimpleNamespace(rank=0, size=1))

    def run_with(scores):
        reward = CombinedReward(config.reward, reward_model=lambda samples: scores)
        return SimpleNamespace(reward=reward, tokenizer=tokenizer, config=config, runtime=runtime)

    got = score_round(run_with([0.7, float("nan")]), examples, rollout, {})
    assert got.rewards == [0.7, 0.0] and got.failed == [False, True] and got.metrics["reward/failures"] == 1.0
    with pytest.raises(RewardsFailedError, match="all 2 samples of this step failed their reward"):
        score_round(run_with([float("nan"), float("inf")]), examples, rollout, {})
