"""The run configuration: one tree of dataclasses, the only place run defaults live.

``RunConfig`` nests the settings of each part of a run. Sub-configs owned by other packages are
reused, not repeated: ``ParallelConfig`` (parallel/), the algorithm configs (megarlhf.algorithms),
``DataConfig`` (megarlhf.data), ``RewardConfig`` (megarlhf.rewards), ``RolloutConfig``
(megarlhf.rollout) and ``GateConfig`` (megarlhf.rollout.gates). Each dataclass validates its
own fields in ``__post_init__``; :class:`RunConfig` adds the checks that span sections. A recipe is a
YAML file with any subset of these keys, loaded by :func:`megarlhf.config.load_config`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from megarlhf.algorithms import (ADVANTAGE_ESTIMATORS, AGGREGATION_MODES, POLICY_LOSSES, AdvantageConfig,
                                 DynamicSamplingConfig, EstimatorNeeds, KLConfig, MismatchConfig, OverlongConfig,
                                 PolicyLossConfig)
from megarlhf.core.dtypes import check_dtype_name
from megarlhf.algorithms.preference_losses import PREFERENCE_LOSSES, PreferenceLossConfig
from megarlhf.data.preference import PreferenceDataConfig
from megarlhf.data.source import DataConfig
from megarlhf.rollout.gates import GateConfig, coarser_dtype
from megarlhf.rewards import RewardConfig, RewardSpec
from megarlhf.rollout.config import RolloutConfig, vllm_lora_rank
from megarlhf.records.tracking import TRACKERS
from model_providers.moe import MoEConfig
from parallel.config import ParallelConfig
from parallel.lora import LoRAConfig


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _positive_int(owner: object, *names: str, where: str = "") -> None:
    for name in names:
        value = getattr(owner, name)
        _check(isinstance(value, int) and value >= 1,
               f"{where or type(owner).__name__}.{name} must be an int >= 1, got {value!r}")


@dataclass
class ModelConfig:
    path: str  # HF model directory (the actor, and the reference model)
    dtype: str = "bfloat16"  # the trainer's parameter dtype (megarlhf.core.dtypes: float32, bfloat16)
    critic_path: str | None = None  # HF directory the critic starts from (None: the actor's path)
    # LoRA adapters on the actor and critic (parallel.lora); the base weights are frozen, and the
    # reference policy is the base model with adapters off (None: train all weights)
    lora: LoRAConfig | None = None
    # router training signals of a mixture-of-experts model (load-balancing and z-loss; off by default)
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self):
        check_dtype_name(self.dtype, "ModelConfig.dtype")


@dataclass
class AlgorithmConfig:
    """Which estimator and loss, and their settings (the sub-configs are megarlhf.algorithms')."""

    estimator: str = "grpo"  # a name in ADVANTAGE_ESTIMATORS (its entry declares what it needs)
    policy_loss: str = "ppo_clip"  # a name in POLICY_LOSSES
    loss_aggregation: Literal[AGGREGATION_MODES] = "token_mean"
    kl_mode: Literal["loss", "reward", "none"] = "loss"  # KL to the reference: loss term, reward penalty, off
    entropy_coef: float = 0.0
    value_clip: float | None = 0.2  # PPO value-loss clip range (critic only)
    # DAPO: keep generating until the batch holds enough groups whose rewards are not all equal
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    policy: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    overlong: OverlongConfig | None = None  # DAPO overlong reward shaping (None: off)
    # MoE actors: route the old-log-prob pass and the update as the rollout engine did (r3), the update as the
    # old-log-prob pass did (r2), or freely (none); megarlhf.learner.routing_replay
    routing_replay: Literal["none", "r2", "r3"] = "none"

    def __post_init__(self):
        _check(self.estimator in ADVANTAGE_ESTIMATORS,
               f"AlgorithmConfig.estimator: unknown advantage estimator {self.estimator!r}; "
               f"known: {', '.join(ADVANTAGE_ESTIMATORS.names())}")
        _check(self.policy_loss in POLICY_LOSSES,
               f"AlgorithmConfig.policy_loss: unknown policy loss {self.policy_loss!r}; "
               f"known: {', '.join(POLICY_LOSSES.names())}")
        _check(self.value_clip is None or self.value_clip > 0,
               f"AlgorithmConfig.value_clip must be > 0 or null, got {self.value_clip}")

    @property
    def needs(self) -> EstimatorNeeds:
        """What the configured estimator declared it needs (critic, groups, greedy baseline)."""
        return ADVANTAGE_ESTIMATORS.get(self.estimator).needs

    @property
    def uses_critic(self) -> bool:
        return self.needs.critic

    @property
    def kl_in_loss(self) -> bool:
        """A KL-to-reference term with weight is added to the actor's loss."""
        return self.kl_mode == "loss" and self.kl.coef > 0

    @property
    def kl_in_reward(self) -> bool:
        """A KL-to-reference penalty with weight is added to the token rewards."""
        return self.kl_mode == "reward" and self.kl.coef > 0

    @property
    def uses_reference(self) -> bool:
        """The one definition of "KL is on": a frozen reference model is built, scored and used only
        for a KL term that has weight (``kl.coef = 0`` switches KL off in either mode)."""
        return self.kl_in_loss or self.kl_in_reward


@dataclass
class PreferenceConfig:
    """Preference learning (``megarlhf dpo`` and ``megarlhf rm``): the loss and the rows' keys."""

    # a name in PREFERENCE_LOSSES (dpo, ipo, simpo on pairs; kto on unpaired rows); megarlhf dpo
    loss: str = "dpo"
    params: PreferenceLossConfig = field(default_factory=PreferenceLossConfig)
    keys: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    # megarlhf dpo: the reference's log-probs of the whole dataset are computed once before training and
    # the reference model is then dropped (False: computed per step, the model offloaded in between)
    precompute_reference: bool = False
    rm_margin: float = 0.0  # megarlhf rm: the Bradley-Terry margin m in -logsigmoid(s_w - s_l - m)

    def __post_init__(self):
        _check(self.loss in PREFERENCE_LOSSES,
               f"PreferenceConfig.loss: unknown preference loss {self.loss!r}; known: "
               f"{', '.join(PREFERENCE_LOSSES.names())}")
        _check(PREFERENCE_LOSSES.get(self.loss).label_smoothing or self.params.label_smoothing == 0,
               f"PreferenceConfig: preference.loss={self.loss!r} has no label smoothing; set "
               f"preference.params.label_smoothing=0 (got {self.params.label_smoothing})")
        _check(self.rm_margin >= 0, f"PreferenceConfig.rm_margin must be >= 0, got {self.rm_margin}")

    @property
    def needs_reference(self) -> bool:
        return PREFERENCE_LOSSES.get(self.loss).needs_reference

    @property
    def paired(self) -> bool:
        """True when the loss reads preference pairs, False for unpaired rows (prompt, completion, label)."""
        return PREFERENCE_LOSSES.get(self.loss).paired


@dataclass
class IterativeConfig:
    """Rejection sampling (``megarlhf rs``) and online DPO (``megarlhf online-dpo``): what each round keeps of
    its samples (:mod:`megarlhf.algorithms.selection`) and how it trains on them."""

    # rs: "best" keeps each prompt's best sample if its reward is >= rs_threshold (null: always);
    # "threshold" keeps every sample whose reward is >= rs_threshold (which must then be set)
    rs_keep: Literal["best", "threshold"] = "best"
    rs_threshold: float | None = 0.5  # 0.5: a 0/1 verifier's correct answers only
    # online-dpo: "best_worst" (one pair per prompt) or "all" (every pair of a prompt's samples)
    pair_rule: Literal["best_worst", "all"] = "best_worst"
    min_margin: float = 0.0  # online-dpo: a reward gap at or below this is a tie: no pair
    # online-dpo, for losses with a reference: "fixed" (model.path throughout) or "refresh" (the policy as
    # it was when the round began)
    reference: Literal["fixed", "refresh"] = "fixed"
    # a sample the token limit cut off (finish reason "length") is kept (rs) or chosen (online-dpo) only
    # when true: its response has no end-of-sequence, and training towards it teaches stopping mid-answer
    keep_truncated: bool = False

    def __post_init__(self):
        _check(self.rs_keep != "threshold" or self.rs_threshold is not None,
               "IterativeConfig.rs_keep='threshold' needs rs_threshold (the reward a kept sample reaches)")
        _check(self.rs_threshold is None or math.isfinite(self.rs_threshold),
               f"IterativeConfig.rs_threshold must be finite or null, got {self.rs_threshold}")
        _check(math.isfinite(self.min_margin) and self.min_margin >= 0,
               f"IterativeConfig.min_margin must be a finite number >= 0, got {self.min_margin}")


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0  # reached at the end of a cosine/linear schedule
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # max global gradient norm (0: off)
    critic_lr: float | None = None  # None: the actor's lr
    use_distributed_optimizer: bool = True  # Megatron's optimizer-state sharding over data parallel

    def __post_init__(self):
        _check(self.lr > 0, f"OptimConfig.lr must be > 0, got {self.lr}")
        _check(0 <= self.min_lr <= self.lr, f"OptimConfig.min_lr must be in [0, lr], got {self.min_lr}")
        _check(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0,
               f"OptimConfig.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        _check(self.weight_decay >= 0 and self.clip_grad >= 0,
               f"OptimConfig.weight_decay and clip_grad must be >= 0, got {self.weight_decay}, {self.clip_grad}")
        _check(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1,
               f"OptimConfig.adam_beta1/2 must be in [0, 1), got {self.adam_beta1}, {self.adam_beta2}")


@dataclass
class RecomputeConfig:
    """Activation recomputation of the trained models (Megatron's ``recompute_*`` TransformerConfig fields).

    ``full`` keeps only the input of each checkpointed chunk of layers and recomputes the chunk in
    backward: ``uniform`` checkpoints every chunk of ``num_layers`` layers, ``block`` the first
    ``num_layers`` layers of each pipeline stage (one at a time) and stores the rest. Megatron's
    ``selective`` granularity is not offered: it recomputes the core attention to avoid storing its
    O(tokens^2) softmax, and megarlhf's attention (SDPA / flash-style tiles) never stores one.
    """

    granularity: Literal["none", "full"] = "none"
    method: Literal["uniform", "block"] = "uniform"
    num_layers: int = 1

    def __post_init__(self):
        _positive_int(self, "num_layers")

    def transformer_config_fields(self) -> dict:
        """The TransformerConfig fields that switch it on (none when ``granularity`` is "none")."""
        if self.granularity == "none":
            return {}
        return {"recompute_granularity": "full", "recompute_method": self.method,
                "recompute_num_layers": self.num_layers}


@dataclass
class TrainConfig:
    steps: int = 100  # RL steps (or SFT optimizer steps)
    global_batch_size: int = 64  # prompts per RL step (SFT: examples per step)
    mini_batches: int = 1  # optimizer updates per RL step (the global batch is split into this many)
    epochs_per_step: int = 1  # passes over the step's samples (PPO epochs)
    micro_batch_tokens: int = 8192  # token budget of one packed micro-batch
    packing: bool = True  # pack sequences into micro-batches up to the token budget
    # packed, at context_parallel_size 1 (else ignored): sequences that begin with the same prompt (a
    # group's samples, a preference pair) hold it once in their micro-batch, computed once
    share_prompt_prefix: bool = True
    on_nonfinite: Literal["abort", "skip"] = "abort"  # a NaN/Inf loss or gradient: stop, or skip the batch
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)  # activation recomputation

    def __post_init__(self):
        _positive_int(self, "steps", "global_batch_size", "mini_batches", "epochs_per_step", "micro_batch_tokens")
        _check(self.global_batch_size % self.mini_batches == 0,
               f"TrainConfig.global_batch_size ({self.global_batch_size}) must be divisible by "
               f"mini_batches ({self.mini_batches})")

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates of the actor (and critic) per RL step."""
        return self.mini_batches * self.epochs_per_step


@dataclass
class CheckpointConfig:
    dir: str | None = None  # None: <logging.run_dir>/checkpoints
    every: int = 50  # steps between checkpoints (0: only at the end)
    keep_last: int | None = 3  # None: keep all
    resume: str = "auto"  # "auto" (latest in dir, if any), "none", or a checkpoint path
    # write checkpoints in the background while training goes on; each is published (marker + rename)
    # once written, at the start of a later step or at the end of the run (megarlhf/checkpoint/async_save.py)
    async_save: bool = False

    def __post_init__(self):
        _check(isinstance(self.async_save, bool), f"CheckpointConfig.async_save must be true or false, got "
               f"{self.async_save!r}")
        _check(isinstance(self.every, int) and self.every >= 0,
               f"CheckpointConfig.every must be an int >= 0, got {self.every!r}")
        _check(self.keep_last is None or self.keep_last >= 1,
               f"CheckpointConfig.keep_last must be >= 1 or null, got {self.keep_last}")
        _check(bool(self.resume), "CheckpointConfig.resume must be 'auto', 'none' or a checkpoint path")


@dataclass
class EvalConfig:
    every: int = 0  # steps between evaluations on data.eval_path (0: off)
    n_samples: int = 1  # responses per eval prompt
    pass_at_k: list[int] = field(default_factory=lambda: [1])
    temperature: float = 0.0
    max_prompts: int | None = None  # None: the whole eval set
    # what "correct" means on held-out prompts (a response is correct when these score > 0.5); None: the
    # run's reward.functions. Never the learned reward model: evaluation measures the task, not the proxy.
    reward_functions: list[RewardSpec] | None = None

    def __post_init__(self):
        _check(isinstance(self.every, int) and self.every >= 0, f"EvalConfig.every must be >= 0, got {self.every!r}")
        _positive_int(self, "n_samples")
        bad = [k for k in self.pass_at_k if not 1 <= k <= self.n_samples]
        _check(not bad, f"EvalConfig.pass_at_k values must be in [1, n_samples={self.n_samples}], got {bad}")


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"  # metrics.jsonl, config.yaml, checkpoints, the trackers' files
    # experiment trackers (megarlhf.records.tracking): any of tensorboard, wandb, mlflow; [] for metrics.jsonl only
    backends: list[str] = field(default_factory=lambda: ["tensorboard"])
    project: str = "megarlhf"  # the W&B project / MLflow experiment
    run_name: str | None = None  # the W&B / MLflow run's name (None: the run directory's name)
    wandb_mode: Literal["online", "offline"] | None = None  # None: W&B's own choice (WANDB_MODE, wandb login)
    mlflow_tracking_uri: str | None = None  # None: MLFLOW_TRACKING_URI (mlflow needs one or the other)
    log_every: int = 1  # steps between metric records (RL and SFT; the last step and evaluations always)
    samples_per_step: int = 4  # RL: decoded samples per step and per evaluation in samples.jsonl (0: off)

    def __post_init__(self):
        _positive_int(self, "log_every")
        _check(isinstance(self.samples_per_step, int) and self.samples_per_step >= 0,
               f"LoggingConfig.samples_per_step must be an int >= 0, got {self.samples_per_step!r}")
        unknown = [b for b in self.backends if b not in TRACKERS]
        _check(not unknown, f"LoggingConfig.backends: unknown tracking backend(s) {unknown}; "
                            f"known: {', '.join(TRACKERS.names())}")
        _check(len(set(self.backends)) == len(self.backends),
               f"LoggingConfig.backends names a backend twice: {self.backends}")


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
    seed: int = 1234

    def __post_init__(self):
        _check(self.eval.every == 0 or self.eval_reward is not None,
               "eval.every > 0 needs a verifier to score held-out answers: reward.functions is empty (a learned "
               "reward only), so set eval.reward_functions (e.g. [{name: math_verify}])")
        _check(not self.algorithm.needs.groups or self.rollout.n_samples >= 2,
               f"algorithm.estimator {self.algorithm.estimator!r} compares samples of a prompt: "
               f"rollout.n_samples must be >= 2, got {self.rollout.n_samples}")
        overlong = self.algorithm.overlong
        _check(overlong is None or overlong.buffer_length < self.rollout.response_budget,
               f"algorithm.overlong.buffer_length ({overlong and overlong.buffer_length}) must be < "
               f"the response budget ({self.rollout.response_budget}: rollout.max_new_tokens, or "
               f"rollout.max_response_tokens in multi-turn rollouts)")
        _check(self.rollout.env is None or not self.algorithm.dynamic_sampling.enabled,
               "rollout.env (multi-turn rollouts) with algorithm.dynamic_sampling is not supported: DAPO's rounds "
               "regroup single-turn samples; turn dynamic sampling off for tool-calling runs")
        _check(self.rollout.max_staleness == 0 or self.algorithm.mismatch.tis_level is not None,
               f"rollout.max_staleness={self.rollout.max_staleness} samples with weights up to that many updates "
               "behind: algorithm.mismatch.tis_level "
               "must be 'token' or 'sequence' so that the update corrects for it (it is null)")
        _check(self.rollout.max_staleness == 0 or not self.algorithm.needs.greedy_baseline,
               f"rollout.max_staleness={self.rollout.max_staleness} with algorithm.estimator="
               f"{self.algorithm.estimator!r}: its greedy "
               f"baseline is generated inside the step with the current weights; use max_staleness=0")
        self._check_adapter_sync()

    def _check_adapter_sync(self) -> None:
        """``rollout.weight_sync.lora='adapter'`` needs what the adapter-only sync is built for."""
        if self.rollout.weight_sync.lora != "adapter":
            return
        where = "rollout.weight_sync.lora='adapter' (adapters sent to vLLM's LoRA kernels)"
        _check(self.model.lora is not None, f"{where} needs model.lora: the model has no adapters to send")
        _check(self.rollout.backend == "vllm", f"{where} needs rollout.backend='vllm' (got "
               f"{self.rollout.backend!r}); the HF engine takes merged weights (weight_sync.lora='merged')")
        _check(self.rollout.tensor_parallel_size == 1,
               f"{where} verifies the engine's adapter slots of a whole (TP=1) engine: rollout.tensor_parallel_size "
               f"must be 1, got {self.rollout.tensor_parallel_size} (use weight_sync.lora='merged')")
        vllm_lora_rank(self.model.lora.rank)  # raises past the largest rank vLLM serves
        engine_dtype = self.rollout.engine_dtype(self.model.dtype)
        _check(self.rollout.weight_sync.check_checkpoint and coarser_dtype(self.model.dtype, engine_dtype) == engine_dtype,
               f"{where} never sends the base weights, so the engine's own load of model.path must be proven equal "
               f"to the trainer's at start-up: it needs rollout.weight_sync.check_checkpoint=true and an engine dtype "
               f"({engine_dtype}) no finer than model.dtype ({self.model.dtype})")

    @property
    def eval_reward(self) -> RewardConfig | None:
        """The reward evaluation scores with: ``eval.reward_functions`` (default ``reward.functions``) with
        the run's timeouts and no reward model; None when there is no function to score with."""
        functions = self.eval.reward_functions if self.eval.reward_functions is not None else self.reward.functions
        if not functions:
            return None
        return RewardConfig(functions=list(functions), timeout_s=self.reward.timeout_s,
                            failure_reward=self.reward.failure_reward, num_workers=self.reward.num_workers)
