"""The ``teacher`` section (a frozen model that scores the student's tokens) and ``algorithm.distill`` (what
the RL loop learns from it: on-policy distillation's per-token reverse KL, or GKD's generalized JSD)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from megarlhf.config.parallel import ParallelConfig
from megarlhf.config.validate import check
from megarlhf.core.dtypes import check_dtype_name


@dataclass
class TeacherConfig:
    """A frozen causal LM from ``model_path`` that scores every response token of the student's samples
    (its log-prob of the sampled token and, when the distillation loss needs it, its top-k). It runs in the
    trainer's parallel layout, or in a layout of its own over the same trainer ranks (``parallel``: a larger
    teacher at a larger TP, say), colocated with the actor and offloaded like the reference while the engines
    generate. It must read the student's token ids: a teacher with another tokenizer is refused at start-up."""

    model_path: str  # HF directory of the teacher
    dtype: str | None = None  # None: model.dtype
    # the teacher's own tensor/pipeline/context(/expert) split of the trainer ranks; its data-parallel size is
    # what is left (None: the trainer's layout)
    parallel: ParallelConfig | None = None

    def __post_init__(self):
        check(isinstance(self.model_path, str) and bool(self.model_path),
              f"TeacherConfig.model_path must be a non-empty path, got {self.model_path!r}")
        if self.dtype is not None:
            check_dtype_name(self.dtype, "TeacherConfig.dtype")


@dataclass
class DistillConfig:
    """Distillation from ``teacher`` in the RL loop (:mod:`megarlhf.algorithms.distillation`): ``loss`` names
    an entry of DISTILL_LOSSES, whose declaration says where it enters (the per-token advantage, or the loss)
    and what it needs; ``coef`` weighs it against the estimator's task advantage (``algorithm.estimator:
    none`` trains on the teacher alone)."""

    loss: str = "reverse_kl"  # a name in DISTILL_LOSSES
    coef: float = 1.0
    top_k: int = 0  # the teacher's top-k per response token, for a loss that compares distributions (gkd)
    beta: float = 0.5  # gkd: the generalized JSD's interpolation (0: KL(teacher||student), 1: KL(student||teacher))
    # gkd: the fraction of steps that train on the student's own samples; the others train on the prompts'
    # dataset responses (TRL's GKDTrainer lmbda)
    lmbda: float = 1.0

    def __post_init__(self):
        check(isinstance(self.loss, str) and bool(self.loss), f"DistillConfig.loss must be a name, got {self.loss!r}")
        check(isinstance(self.coef, (int, float)) and math.isfinite(self.coef) and self.coef > 0,
              f"DistillConfig.coef must be a finite number > 0, got {self.coef!r}")
        check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0,
              f"DistillConfig.top_k must be an int >= 0, got {self.top_k!r}")
        for name in ("beta", "lmbda"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and 0.0 <= value <= 1.0,
                  f"DistillConfig.{name} must be a number in [0, 1], got {value!r}")
