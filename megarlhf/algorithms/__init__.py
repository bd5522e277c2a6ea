"""RL numerics: advantage estimators, policy/value losses, KL estimators, loss aggregation across
micro-batches and data-parallel ranks, rollout/trainer mismatch correction, and DAPO's data techniques.

The three registries (:data:`ADVANTAGE_ESTIMATORS`, :data:`POLICY_LOSSES`, :data:`KL_ESTIMATORS`) each
hold entries of one call signature; the modules' docstrings state the formulas and the papers. An
advantage estimator also declares what it needs from the run (:class:`EstimatorNeeds`).
"""
from megarlhf.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, AdvantageOutputs, EstimatorNeeds
from megarlhf.algorithms.aggregation import LossNormaliser, aggregate_loss, compute_normaliser
from megarlhf.algorithms.dapo import GroupFilterResult, dynamic_sampling_filter, overlong_penalty
from megarlhf.algorithms.kl import KL_ESTIMATORS, kl_loss, kl_reward_penalty
from megarlhf.algorithms.mismatch import MismatchOutput, logprob_gap_mask, rollout_correction, truncated_is_weights
from megarlhf.algorithms.policy_losses import POLICY_LOSSES, LossOutput, PolicyLossInputs, entropy_bonus, value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AdvantageInputs", "AdvantageOutputs", "EstimatorNeeds", "LossNormaliser", "aggregate_loss", "compute_normaliser", "GroupFilterResult", "dynamic_sampling_filter", "overlong_penalty",
    "KL_ESTIMATORS", "kl_loss", "kl_reward_penalty", "MismatchOutput", "logprob_gap_mask", "rollout_correction", "truncated_is_weights",
    "POLICY_LOSSES", "LossOutput", "PolicyLossInputs", "entropy_bonus", "value_loss",
]
