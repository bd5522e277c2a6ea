"""The ``preference`` and ``iterative`` sections: DPO-family and reward-model training, rejection sampling
and online DPO."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from megarlhf.config.data import PreferenceDataConfig
from megarlhf.config.validate import check
from megarlhf.core.errors import ConfigError


@dataclass
class PreferenceLossConfig:
    """Settings of the preference losses (the only place their defaults live)."""

    # dpo: the KL-regularisation strength beta (Rafailov et al. 2023 use 0.1); ipo: the regularisation
    # tau of Azar et al. 2023 (the loss pulls the log-ratio margin to 1 / (2 tau))
    beta: float = 0.1
    # dpo, simpo: the assumed probability that a preference label is flipped (conservative DPO, Mitchell
    # 2023); 0 is the plain loss. ipo has no such term and refuses a non-zero value.
    label_smoothing: float = 0.0
    # simpo: its own beta, because its reward is a per-token average log-prob, on a scale ~|y| times
    # smaller than DPO's summed log-ratio: the SimPO paper's configs use 2.0-2.5, not DPO's 0.1
    simpo_beta: float = 2.0
    # simpo: the paper's target reward margin gamma, in reward units: -logsigmoid(r_w - r_l - gamma).
    # The SimPO repository's newer configs give the ratio gamma / beta instead (0.5 with beta 2.0 for
    # Llama-3-8B-Base, hence 1.0 here; its Mistral-7B-Base config has gamma 1.6 with beta 2.0).
    # TRL's CPOConfig.simpo_gamma is this same gamma.
    simpo_gamma: float = 1.0
    # kto: the weights of the desirable and undesirable rows' losses (KTO paper, Eq. 8: lambda_D, lambda_U).
    # The paper suggests choosing them so that desirable_weight * n_D / (undesirable_weight * n_U) lies in
    # [1, 4/3] for n_D desirable and n_U undesirable rows.
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self):
        for name in ("beta", "label_smoothing", "simpo_beta", "simpo_gamma", "desirable_weight",
                     "undesirable_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"PreferenceLossConfig.{name} must be a finite number, got {value!r}")
        for name in ("beta", "simpo_beta", "desirable_weight", "undesirable_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PreferenceLossConfig.{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"PreferenceLossConfig.label_smoothing must be in [0, 0.5) (a label-flip "
                             f"probability; 0.5 or more inverts the preferences), got {self.label_smoothing}")
        if self.simpo_gamma < 0:
            raise ValueError(f"PreferenceLossConfig.simpo_gamma must be >= 0, got {self.simpo_gamma}")


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
        check(self.rm_margin >= 0, f"PreferenceConfig.rm_margin must be >= 0, got {self.rm_margin}")


@dataclass
class IterativeConfig:
    """Rejection sampling (``megarlhf rs``) and online DPO (``megarlhf online-dpo``): what each round keeps of
    its samples (:mod:`megarlhf.algorithms.selection`) and how it trains on them."""

    # rs: "best" keeps each prompt's best sample if its reward is >= rs_threshold (null: always);
    # "threshold" keeps every sample whose reward is >= rs_threshold (which must then be set)
    rs_keep: Literal["best", "threshold"] = "best"
    # "auto": 0.5 (a 0/1 verifier's correct answers only) for rule rewards; with a learned reward
    # (reward.reward_model_path), whose scores have no fixed scale, null for rs_keep=best (each prompt's best)
    # and an error for rs_keep=threshold (a learned reward's threshold must be chosen)
    rs_threshold: float | Literal["auto"] | None = "auto"
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
        check(self.rs_keep != "threshold" or self.rs_threshold is not None,
              "IterativeConfig.rs_keep='threshold' needs rs_threshold (the reward a kept sample reaches)")
        check(self.rs_threshold in (None, "auto") or math.isfinite(self.rs_threshold),
              f"IterativeConfig.rs_threshold must be a finite number, 'auto' or null, got {self.rs_threshold}")
        check(math.isfinite(self.min_margin) and self.min_margin >= 0,
              f"IterativeConfig.min_margin must be a finite number >= 0, got {self.min_margin}")

    def keep_threshold(self, learned_reward: bool) -> float | None:
        """The reward a kept sample reaches (None: each prompt's best is kept whatever its reward), with
        "auto" resolved for a run whose reward is (``learned_reward``) or is not a learned reward model."""
        if self.rs_threshold != "auto":
            return self.rs_threshold
        if not learned_reward:
            return 0.5
        if self.rs_keep == "threshold":
            raise ConfigError("iterative.rs_keep='threshold' with a learned reward (reward.reward_model_path) needs an "
                              "explicit iterative.rs_threshold: its scores have no fixed scale")
        return None
