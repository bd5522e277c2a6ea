"""The training engine under the RL and SFT trainers.

* :mod:`~megarlhf.training.models`: actor / critic (Megatron DDP + optimizer + lr schedule) and the
  frozen reference, from a ``RunConfig``.
* :mod:`~megarlhf.training.batch`: the experience batch and its token-aligned [B, L] layout.
* :mod:`~megarlhf.training.packing`: token-budgeted micro-batches, packed or padded, CP-sharded.
* :mod:`~megarlhf.training.forward`: the one forward (fused log-probs / entropy, or values) through
  Megatron's schedule.
* :mod:`~megarlhf.training.step`: one optimizer step with the non-finite gate.
* :mod:`~megarlhf.training.update`: scoring, ``actor_update``, ``critic_update``.
* :mod:`~megarlhf.training.sft`: ``sft_step``.
* :mod:`~megarlhf.training.preference`: DPO-family and reward-model steps on preference pairs.
"""
from megarlhf.training.batch import ExperienceBatch
from megarlhf.training.models import (TrainModel, build_actor, build_critic, build_frozen, build_reference,
                                      build_reward_model, export_policy,
                                      params_dtype, rl_optimizer_steps)
from megarlhf.training.packing import MicroBatch, build_micro_batches, plan_micro_batches
from megarlhf.training.sft import sft_batch, sft_step
from megarlhf.training.step import NONFINITE_MODES, NonFiniteError, OptimizerStepResult, optimizer_step
from megarlhf.training.update import (actor_update, compute_logprobs, compute_values, critic_update,
                                      old_logprobs_from_update, old_policy_logprobs)

__all__ = [
    "ExperienceBatch", "TrainModel", "build_actor", "build_critic", "build_frozen", "build_reference",
    "build_reward_model", "export_policy", "params_dtype",
    "rl_optimizer_steps", "MicroBatch", "build_micro_batches", "plan_micro_batches", "sft_batch", "sft_step",
    "NONFINITE_MODES", "NonFiniteError", "OptimizerStepResult", "optimizer_step", "actor_update", "compute_logprobs",
    "compute_values", "critic_update", "old_logprobs_from_update", "old_policy_logprobs",
]
