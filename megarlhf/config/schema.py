"""The run configuration: one tree of dataclasses, the only place run defaults live.

``RunConfig`` nests every section's settings dataclass (the modules of this package, one per section).
Each dataclass validates its own fields in ``__post_init__``; :class:`RunConfig` adds the checks that span
sections. Names of registry entries are checked against their registries when a run starts
(:mod:`megarlhf.run.checks`), because the registries live above this layer. A recipe is a YAML file with any
subset of these keys, loaded by :func:`megarlhf.config.load_config`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megarlhf.config.algorithm import AlgorithmConfig
from megarlhf.config.data import DataConfig
from megarlhf.config.distill import TeacherConfig
from megarlhf.config.model import ModelConfig
from megarlhf.config.parallel import ParallelConfig
from megarlhf.config.preference import IterativeConfig, PreferenceConfig
from megarlhf.config.reward import RewardConfig
from megarlhf.config.rollout import RolloutConfig
from megarlhf.config.train import (CheckpointConfig, EvalConfig, GateConfig, LoggingConfig, OptimConfig,
                                   TrainConfig)
from megarlhf.config.validate import check
from megarlhf.core.dtypes import coarser_dtype


@dataclass
class RunConfig:
    """Everything one RL or SFT run reads. ``model.path`` is required; ``data.train_path`` is required by
    the training commands (``megarlhf train`` / ``sft``), not by ``eval`` or ``export``."""

    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    # One layout for actor, critic and reference: Megatron-Core's parallel state is process-global.
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    gates: GateConfig = field(default_factory=GateConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)  # megarlhf dpo / rm / online-dpo
    iterative: IterativeConfig = field(default_factory=IterativeConfig)  # megarlhf rs / online-dpo
    teacher: TeacherConfig | None = None  # a frozen model the student learns from (algorithm.distill)
    seed: int = 1234

    def __post_init__(self):
        reward = self.reward
        check(bool(reward.functions) or reward.reward_model_path is not None or reward.judge is not None
              or self.rollout.env is not None or self.algorithm.distill is not None,
              "reward.functions is empty and there is no reward_model_path or judge: with no rollout.env (whose "
              "rewards would be the reward) and no algorithm.distill (a teacher) nothing would score the samples")
        check((self.teacher is None) == (self.algorithm.distill is None),
              "teacher and algorithm.distill go together: the teacher is the model algorithm.distill learns from "
              f"(teacher is {'set' if self.teacher else 'unset'}, algorithm.distill "
              f"{'set' if self.algorithm.distill else 'unset'})")
        check(self.eval.every == 0 or self.eval_reward is not None,
              "eval.every > 0 needs a verifier to score held-out answers: reward.functions is empty (a learned "
              "reward, a judge or the environment's rewards only), so set eval.reward_functions "
              "(e.g. [{name: math_verify}])")
        overlong = self.algorithm.overlong
        check(overlong is None or overlong.buffer_length < self.rollout.response_budget,
              f"algorithm.overlong.buffer_length ({overlong and overlong.buffer_length}) must be < "
              f"the response budget ({self.rollout.response_budget}: rollout.max_new_tokens, or "
              f"rollout.max_response_tokens in multi-turn rollouts)")
        check(self.rollout.env is None or not self.algorithm.dynamic_sampling.enabled,
              "rollout.env (multi-turn rollouts) with algorithm.dynamic_sampling is not supported: DAPO's rounds "
              "regroup single-turn samples; turn dynamic sampling off for tool-calling runs")
        check(self.rollout.max_staleness == 0 or self.algorithm.mismatch.tis_level is not None,
              f"rollout.max_staleness={self.rollout.max_staleness} samples with weights up to that many updates "
              "behind: algorithm.mismatch.tis_level "
              "must be 'token' or 'sequence' so that the update corrects for it (it is null)")
        self._check_adapter_sync()

    def _check_adapter_sync(self) -> None:
        """``rollout.weight_sync.lora='adapter'`` needs what the adapter-only sync is built for."""
        if self.rollout.weight_sync.lora != "adapter":
            return
        where = "rollout.weight_sync.lora='adapter' (adapters sent to the engine's LoRA kernels)"
        check(self.model.lora is not None, f"{where} needs model.lora: the model has no adapters to send")
        check(self.rollout.tensor_parallel_size == 1,
              f"{where} verifies the engine's adapter slots of a whole (TP=1) engine: rollout.tensor_parallel_size "
              f"must be 1, got {self.rollout.tensor_parallel_size} (use weight_sync.lora='merged')")
        engine_dtype = self.rollout.engine_dtype(self.model.dtype)
        coarse_engine = coarser_dtype(self.model.dtype, engine_dtype) == engine_dtype
        check(self.rollout.weight_sync.check_checkpoint and coarse_engine,
              f"{where} never sends the base weights, so the engine's own load of model.path must be proven equal "
              f"to the trainer's at start-up: it needs rollout.weight_sync.check_checkpoint=true and an engine dtype "
              f"({engine_dtype}) no finer than model.dtype ({self.model.dtype})")

    @property
    def eval_reward(self) -> RewardConfig | None:
        """The reward evaluation scores with: ``eval.reward_functions`` (default ``reward.functions``) with
        the run's timeouts and no reward model or judge; None when there is no function to score with."""
        functions = self.eval.reward_functions if self.eval.reward_functions is not None else self.reward.functions
        if not functions:
            return None
        return RewardConfig(functions=list(functions), timeout_s=self.reward.timeout_s,
                            failure_reward=self.reward.failure_reward, num_workers=self.reward.num_workers)
