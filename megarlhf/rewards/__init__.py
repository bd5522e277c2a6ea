"""Rewards: the :data:`REWARDS` registry (one per-sample signature), rule-based answer checkers, user
functions by dotted path, the batch scorers' slots (learned reward model, LLM judge), and
:class:`CombinedReward`, which runs the weighted terms with a per-call timeout and reports failures.
"""
from megarlhf.rewards import answers as _answers  # noqa: F401  (registers the built-in rewards)
from megarlhf.rewards import code as _code  # noqa: F401  (registers code_tests)
from megarlhf.rewards import repo as _repo  # noqa: F401  (registers repo_tests)
from megarlhf.rewards.answers import extract_final_answer, parse_number
from megarlhf.rewards.api import (REWARDS, BatchScorer, RewardInput, Unscored, is_dotted_path, load_function,
                                  resolve_reward)
from megarlhf.rewards.runner import CombinedReward, RewardFailure, RewardResult

__all__ = [
    "REWARDS", "RewardInput", "BatchScorer", "Unscored", "is_dotted_path", "load_function",
    "resolve_reward", "extract_final_answer", "parse_number", "CombinedReward", "RewardFailure",
    "RewardResult",
]
