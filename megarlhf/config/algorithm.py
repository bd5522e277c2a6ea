"""The ``algorithm`` section: estimator, policy loss, KL, rollout correction and DAPO shaping settings.

Names of registry entries (``estimator``, ``policy_loss``, ``kl.estimator``) are strings here; the run
checks them against the registries before it starts (:mod:`megarlhf.run.checks`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarlhf.config.distill import DistillConfig
from megarlhf.config.validate import check

# how per-token losses become one number (megarlhf.algorithms.aggregation)
AGGREGATION_MODES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
TIS_LEVELS = ("token", "sequence")  # truncated importance sampling per token or per sequence


@dataclass
class AdvantageConfig:
    """Settings of the advantage estimators (the only place their defaults live)."""

    gamma: float = 1.0  # discount per response token (GAE, REINFORCE++)
    lam: float = 0.95  # GAE lambda
    eps: float = 1e-6  # added to a standard deviation before dividing by it
    gae_whiten: bool = True  # whiten GAE advantages over the (global) batch

    def __post_init__(self):
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"AdvantageConfig.{name} must be in [0, 1], got {value}")
        if not self.eps > 0.0:
            raise ValueError(f"AdvantageConfig.eps must be > 0, got {self.eps}")
        if not isinstance(self.gae_whiten, bool):
            raise ValueError(f"AdvantageConfig.gae_whiten must be a bool, got {self.gae_whiten!r}")


@dataclass
class PolicyLossConfig:
    """Settings of the policy losses (the only place their defaults live)."""

    # ppo_clip: ratio clipped to [1 - clip_eps_low, 1 + clip_eps_high]; PPO is symmetric (0.2, 0.2),
    # DAPO's clip-higher raises the upper bound (0.2, 0.28)
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = None  # ppo_clip: loss for A < 0 is at most -c * A (Ye et al. 2020: c = 3)
    gspo_eps_low: float = 3e-4  # gspo: sequence ratio clipped to [1 - low, 1 + high] (GSPO paper)
    gspo_eps_high: float = 4e-4
    cispo_eps_low: float | None = None  # cispo: IS weight floor 1 - low; None = no floor (MiniMax-M1)
    cispo_eps_high: float = 0.28  # cispo: IS weight cap 1 + high

    def __post_init__(self):
        for name in ("clip_eps_low", "clip_eps_high", "gspo_eps_low", "gspo_eps_high", "cispo_eps_high",
                     "cispo_eps_low"):
            value = getattr(self, name)
            if value is None and name == "cispo_eps_low":
                continue
            if not 0.0 <= value:
                raise ValueError(f"PolicyLossConfig.{name} must be >= 0, got {value}")
        for name in ("clip_eps_low", "gspo_eps_low"):
            if getattr(self, name) >= 1.0:
                raise ValueError(f"PolicyLossConfig.{name} must be < 1 (lower bound 1 - eps > 0), "
                                 f"got {getattr(self, name)}")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ValueError(f"PolicyLossConfig.dual_clip_c must be > 1 or null (off), got {self.dual_clip_c}")


@dataclass
class KLConfig:
    """Which KL estimator, its weight and its clamping (the only place their defaults live)."""

    estimator: str = "k3"  # a name in KL_ESTIMATORS
    coef: float = 0.001  # beta: weight of the KL penalty / loss
    clamp_min: float | None = -10.0  # lower bound on the per-token estimate (None: none)
    clamp_max: float | None = 10.0  # upper bound on the per-token estimate (None: none)
    log_ratio_limit: float = 20.0  # |logprobs - ref_logprobs| is limited to this before estimating

    def __post_init__(self):
        if not self.coef >= 0.0:
            raise ValueError(f"KLConfig.coef must be >= 0, got {self.coef}")
        if not self.log_ratio_limit > 0.0:
            raise ValueError(f"KLConfig.log_ratio_limit must be > 0, got {self.log_ratio_limit}")
        if self.clamp_min is not None and self.clamp_max is not None and self.clamp_min > self.clamp_max:
            raise ValueError(f"KLConfig.clamp_min ({self.clamp_min}) must be <= "
                             f"KLConfig.clamp_max ({self.clamp_max})")



@dataclass
class MismatchConfig:
    """Rollout-correction settings (the only place their defaults live)."""

    tis_level: str | None = "token"  # "token", "sequence", or None for no importance weights
    tis_cap: float = 2.0  # truncation C of the importance weights
    mask_threshold: float | None = None  # drop tokens with |trainer - rollout| log-prob gap above this

    def __post_init__(self):
        if self.tis_level is not None and self.tis_level not in TIS_LEVELS:
            raise ValueError(f"MismatchConfig.tis_level must be one of {TIS_LEVELS} or None, "
                             f"got {self.tis_level!r}")
        if not self.tis_cap > 0.0:
            raise ValueError(f"MismatchConfig.tis_cap must be > 0, got {self.tis_cap}")
        if self.mask_threshold is not None and not self.mask_threshold >= 0.0:
            raise ValueError(f"MismatchConfig.mask_threshold must be >= 0 or None, got {self.mask_threshold}")


@dataclass
class OverlongConfig:
    """Soft overlong punishment settings (the only place their defaults live). The maximum response
    length itself is the rollout's generation limit and is passed in, not repeated here."""

    buffer_length: int = 4096  # L_cache: the penalty ramps over the last buffer_length tokens
    penalty_factor: float = 1.0  # the penalty reached at the maximum length

    def __post_init__(self):
        if not (isinstance(self.buffer_length, int) and self.buffer_length > 0):
            raise ValueError(f"OverlongConfig.buffer_length must be a positive int, "
                             f"got {self.buffer_length!r}")
        if not self.penalty_factor >= 0.0:
            raise ValueError(f"OverlongConfig.penalty_factor must be >= 0, got {self.penalty_factor}")


@dataclass
class DynamicSamplingConfig:
    """DAPO dynamic sampling (the only place its defaults live)."""

    enabled: bool = False
    # generation rounds beyond the first; when they are used up without enough informative groups, the
    # batch is filled with uninformative ones, which are masked out of the update
    max_extra_rounds: int = 4

    def __post_init__(self):
        if not (isinstance(self.max_extra_rounds, int) and 0 <= self.max_extra_rounds <= 64):
            raise ValueError(f"DynamicSamplingConfig.max_extra_rounds must be an int in [0, 64], "
                             f"got {self.max_extra_rounds!r}")


@dataclass
class AlgorithmConfig:
    """Which estimator and loss (registry names), and their settings."""

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
    # learn from a teacher (the run's ``teacher`` section) besides the rewards (None: no teacher)
    distill: DistillConfig | None = None

    def __post_init__(self):
        check(self.value_clip is None or self.value_clip > 0,
              f"AlgorithmConfig.value_clip must be > 0 or null, got {self.value_clip}")

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
