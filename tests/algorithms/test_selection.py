"""Which samples rejection sampling keeps and which pairs online DPO forms, worked by hand: best per
prompt with ties to the first sample, thresholds, interleaved groups, ties and margins forming no pair,
identical responses forming no pair, and bad input refused."""
import pytest

from megarlhf.algorithms.selection import keep_above, keep_best, preference_pairs

# two prompts, interleaved: prompt 7 owns samples 0, 2, 4; prompt 3 owns 1, 3, 5
REWARDS = [0.2, 1.0, 0.9, 1.0, 0.9, 0.0]
PROMPTS = [7, 3, 7, 3, 7, 3]
RESPONSES = [[1], [2], [3], [4], [5], [6]]


def test_keep_best_takes_the_first_best_of_each_prompt():
    assert keep_best(REWARDS, PROMPTS) == [2, 1]  # prompt 7: 0.9 at 2 and 4 -> 2; prompt 3: 1.0 at 1 and 3 -> 1
    assert keep_best(REWARDS, PROMPTS, threshold=0.95) == [1]  # prompt 7's best (0.9) is below
    assert keep_best(REWARDS, PROMPTS, threshold=0.9) == [2, 1]  # at the threshold counts
    assert keep_best([0.0, 0.0], [0, 0], threshold=0.5) == []


def test_keep_above_keeps_every_sample_at_or_over_the_threshold():
    assert keep_above(REWARDS, 0.9) == [1, 2, 3, 4]
    assert keep_above(REWARDS, 2.0) == []


def test_best_worst_pairs_and_ties():
    # prompt 7: best 2 (first 0.9), worst 0 (0.2); prompt 3: best 1 (first 1.0), worst 5 (0.0)
    assert preference_pairs(REWARDS, PROMPTS, RESPONSES) == [(2, 0), (1, 5)]
    # a gap at or below min_margin is a tie: prompt 7's gap is 0.7
    assert preference_pairs(REWARDS, PROMPTS, RESPONSES, min_margin=0.7) == [(1, 5)]
    # an all-equal group forms no pair
    assert preference_pairs([0.5, 0.5, 0.5], [0, 0, 0], [[1], [2], [3]]) == []
    # the worst sample ties: the first one is taken
    assert preference_pairs([0.0, 1.0, 0.0], [0, 0, 0], [[1], [2], [3]]) == [(1, 0)]


def test_all_pairs_rule_and_identical_responses():
    rewards, prompts = [1.0, 0.5, 0.0], [0, 0, 0]
    assert preference_pairs(rewards, prompts, [[1], [2], [3]], rule="all") == [(0, 1), (0, 2), (1, 2)]
    # identical token ids carry no preference even when the rewards differ (a noisy judge)
    assert preference_pairs(rewards, prompts, [[1], [2], [1]], rule="all") == [(0, 1), (1, 2)]
    # best_worst: the worst (2) repeats the best's tokens, so the next-worst distinct response is taken
    assert preference_pairs(rewards, prompts, [[1], [2], [1]]) == [(0, 1)]
    # all: two samples with the same tokens form each pair once
    assert preference_pairs([1.0, 0.0, 0.0], [0, 0, 0], [[1], [2], [2]], rule="all") == [(0, 1)]


def test_samples_not_allowed_are_never_kept_or_chosen():
    # sample 1 (prompt 3's best) was cut off by the token limit: not kept, not chosen, still rejectable
    allowed = [True, False, True, True, True, True]
    assert keep_best(REWARDS, PROMPTS, allowed=allowed) == [2, 3]
    assert keep_above(REWARDS, 0.9, allowed=allowed) == [2, 3, 4]
    assert preference_pairs(REWARDS, PROMPTS, RESPONSES, allowed=allowed) == [(2, 0), (3, 5)]
    assert preference_pairs([0.0, 1.0], [0, 0], [[1], [2]], allowed=[True, False]) == []
    assert keep_best([1.0], [0], allowed=[False]) == []
    with pytest.raises(ValueError, match="1 allowed flags for 2 samples"):
        keep_above([1.0, 0.0], 0.5, allowed=[True])


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="3 rewards for 2 samples"):
        keep_best([1.0, 0.0, 0.0], [0, 0])
    with pytest.raises(ValueError, match="sample 1 has a non-finite reward nan"):
        preference_pairs([1.0, float("nan")], [0, 0], [[1], [2]])
    with pytest.raises(ValueError, match="unknown pair rule 'random'"):
        preference_pairs([1.0], [0], [[1]], rule="random")
    with pytest.raises(ValueError, match="min_margin must be >= 0"):
        preference_pairs([1.0], [0], [[1]], min_margin=-1.0)
