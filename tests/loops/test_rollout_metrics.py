"""The staleness of a rollout's tokens, worked by hand (megarlhf.loops.rollout_metrics.staleness_metrics)."""
import torch

from megarlhf.loops.rollout_metrics import staleness_metrics
from megarlhf.rollout.engines.sampling import RolloutBatch
from parallel.runtime import LaunchEnv, ParallelGroup, Runtime


def _runtime() -> Runtime:
    alone = ParallelGroup.alone()
    return Runtime(LaunchEnv(0, 1, 0, "127.0.0.1", 0, "none"), torch.device("cpu"), alone, alone, alone, alone,
                   alone, alone, alone, alone, 0)


def test_lags_are_counted_per_token_against_the_trained_version():
    """Trained by version 7: a sample of 3 tokens from version 6 (lag 1 each) and one whose first 2 tokens came
    from version 5 and last 3 from version 7 (lags 2, 2, 0, 0, 0): 8 tokens, lags summing to 7."""
    rollout = RolloutBatch(response_ids=[[1, 2, 3], [4, 5, 6, 7, 8]], policy_versions=[[6, 6, 6], [5, 5, 7, 7, 7]])
    assert staleness_metrics(rollout, 7, _runtime()) == {"rollout/staleness": 2.0, "rollout/staleness_mean": 7 / 8}


def test_observation_tokens_of_an_episode_are_not_counted():
    """A multi-turn sample: the two observation tokens (mask 0) carry the version of the turn around them, but
    the model did not sample them. Its 3 model tokens lag 0, 1, 1."""
    rollout = RolloutBatch(response_ids=[[1, 2, 3, 4, 5]], policy_versions=[[4, 4, 4, 3, 3]],
                           loss_masks=[[1, 0, 0, 1, 1]])
    assert staleness_metrics(rollout, 4, _runtime()) == {"rollout/staleness": 1.0, "rollout/staleness_mean": 2 / 3}


def test_a_batch_without_versions_reports_nothing():
    """Dataset responses (GKD's steps off the student) were sampled by no policy; empty responses were, by
    version 2: no token lags."""
    assert staleness_metrics(RolloutBatch(response_ids=[[1, 2]]), 3, _runtime()) == {}
    empty = RolloutBatch(response_ids=[[], []], policy_versions=[[], []])
    assert staleness_metrics(empty, 3, _runtime()) == {"rollout/staleness": 0.0, "rollout/staleness_mean": 0.0}
