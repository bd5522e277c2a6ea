"""The sections of how a run trains and keeps its records: optimizer, steps and batches, activation
recomputation, checkpoints, evaluation, logging and the verification gates' tolerances."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from megarlhf.config.reward import RewardSpec
from megarlhf.config.validate import check, positive_ints


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
        check(self.lr > 0, f"OptimConfig.lr must be > 0, got {self.lr}")
        check(0 <= self.min_lr <= self.lr, f"OptimConfig.min_lr must be in [0, lr], got {self.min_lr}")
        check(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0,
              f"OptimConfig.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        check(self.weight_decay >= 0 and self.clip_grad >= 0,
              f"OptimConfig.weight_decay and clip_grad must be >= 0, got {self.weight_decay}, {self.clip_grad}")
        check(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1,
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
        positive_ints(self, "num_layers")

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
        positive_ints(self, "steps", "global_batch_size", "mini_batches", "epochs_per_step", "micro_batch_tokens")
        check(self.global_batch_size % self.mini_batches == 0,
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
    # how a distributed optimizer's state is saved: "dp_reshardable" (each data-parallel rank writes its own
    # shard, in parallel; resumes at the same tensor/pipeline layout, any data-parallel size) or
    # "fully_reshardable" (gathered onto one rank; resumes at any layout) (megarlhf/checkpoint/optimizer_state.py)
    optimizer_format: str = "dp_reshardable"

    def __post_init__(self):
        check(self.optimizer_format in ("dp_reshardable", "fully_reshardable"),
              f"CheckpointConfig.optimizer_format must be 'dp_reshardable' or 'fully_reshardable', got "
              f"{self.optimizer_format!r}")
        check(isinstance(self.async_save, bool), f"CheckpointConfig.async_save must be true or false, got "
              f"{self.async_save!r}")
        check(isinstance(self.every, int) and self.every >= 0,
              f"CheckpointConfig.every must be an int >= 0, got {self.every!r}")
        check(self.keep_last is None or self.keep_last >= 1,
              f"CheckpointConfig.keep_last must be >= 1 or null, got {self.keep_last}")
        check(bool(self.resume), "CheckpointConfig.resume must be 'auto', 'none' or a checkpoint path")


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
        check(isinstance(self.every, int) and self.every >= 0, f"EvalConfig.every must be >= 0, got {self.every!r}")
        positive_ints(self, "n_samples")
        bad = [k for k in self.pass_at_k if not 1 <= k <= self.n_samples]
        check(not bad, f"EvalConfig.pass_at_k values must be in [1, n_samples={self.n_samples}], got {bad}")


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"  # metrics.jsonl, config.yaml, checkpoints, the trackers' files
    # experiment trackers (names in megarlhf.records.tracking.TRACKERS: tensorboard, wandb, mlflow); [] for
    # metrics.jsonl only
    backends: list[str] = field(default_factory=lambda: ["tensorboard"])
    project: str = "megarlhf"  # the W&B project / MLflow experiment
    run_name: str | None = None  # the W&B / MLflow run's name (None: the run directory's name)
    wandb_mode: Literal["online", "offline"] | None = None  # None: W&B's own choice (WANDB_MODE, wandb login)
    mlflow_tracking_uri: str | None = None  # None: MLFLOW_TRACKING_URI (mlflow needs one or the other)
    log_every: int = 1  # steps between metric records (RL and SFT; the last step and evaluations always)
    samples_per_step: int = 4  # RL: decoded samples per step and per evaluation in samples.jsonl (0: off)
    # performance work: count every RL step's host synchronisations (megarlhf.records.host_syncs) into
    # <run_dir>/logs/host_syncs-rank<N>.jsonl with where each came from (slows the step: off in real runs)
    count_host_syncs: bool = False

    def __post_init__(self):
        positive_ints(self, "log_every")
        check(isinstance(self.samples_per_step, int) and self.samples_per_step >= 0,
              f"LoggingConfig.samples_per_step must be an int >= 0, got {self.samples_per_step!r}")
        check(len(set(self.backends)) == len(self.backends),
              f"LoggingConfig.backends names a backend twice: {self.backends}")
        check(isinstance(self.count_host_syncs, bool),
              f"LoggingConfig.count_host_syncs must be true or false, got {self.count_host_syncs!r}")


@dataclass
class GateConfig:
    """``gates``: verification tolerances set by hand (``null``: the rule's value,
    :mod:`megarlhf.rollout.sync.gates`)."""

    probe_max: float | None = None
    probe_mean: float | None = None
    step0_max: float | None = None
    step0_mean: float | None = None
    step0_ppo_kl: float | None = None

    def __post_init__(self):
        for item in fields(self):
            value = getattr(self, item.name)
            if value is not None and not value > 0:
                raise ValueError(f"GateConfig.{item.name} must be > 0 or null, got {value}")
