"""The learner: the step machinery under every loop (RL, SFT, preference, rounds).

* :mod:`~megarlhf.learner.models`: actor / critic (Megatron DDP + optimizer + lr schedule) and the
  frozen reference, from a ``RunConfig``.
* :mod:`~megarlhf.learner.batch`: the experience batch and its token-aligned [B, L] layout.
* :mod:`~megarlhf.learner.packing`: token-budgeted micro-batches, packed or padded, CP-sharded.
* :mod:`~megarlhf.learner.forward`: the one forward (fused log-probs / entropy, or values) through
  Megatron's schedule.
* :mod:`~megarlhf.learner.step`: one optimizer step with the non-finite gate.
* :mod:`~megarlhf.learner.update`: scoring, ``actor_update``, ``critic_update``.
* :mod:`~megarlhf.learner.sft`: ``sft_step``.
* :mod:`~megarlhf.learner.preference`: DPO-family and reward-model steps on preference pairs.
"""
from megarlhf.learner.batch import ExperienceBatch
from megarlhf.learner.models import (TrainModel, build_actor, build_critic, build_frozen, build_reference,
                                      build_reward_model, export_policy,
                                      params_dtype, rl_optimizer_steps)
from megarlhf.learner.packing import MicroBatch, Packing, build_micro_batches, plan_micro_batches
from megarlhf.learner.sft import sft_batch, sft_step
from megarlhf.learner.step import NONFINITE_MODES, NonFiniteError, OptimizerStepResult, optimizer_step
from megarlhf.learner.update import (actor_update, compute_logprobs, compute_values, critic_update,
                                      old_logprobs_from_update, old_policy_logprobs)

__all__ = [
    "ExperienceBatch", "TrainModel", "build_actor", "build_critic", "build_frozen", "build_reference",
    "build_reward_model", "export_policy", "params_dtype",
    "rl_optimizer_steps", "MicroBatch", "Packing", "build_micro_batches", "plan_micro_batches", "sft_batch", "sft_step",
    "NONFINITE_MODES", "NonFiniteError", "OptimizerStepResult", "optimizer_step", "actor_update", "compute_logprobs",
    "compute_values", "critic_update", "old_logprobs_from_update", "old_policy_logprobs",
]
