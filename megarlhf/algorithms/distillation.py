"""Distillation terms: what the RL loop learns from a teacher's scores of the student's tokens.

Every term is registered in :data:`DISTILL_LOSSES` with one signature::

    term(inputs: DistillInputs, config: DistillConfig) -> Tensor   # [B, T], 0 on masked positions

and declares (:class:`DistillNeeds`) where the RL step adds it, ``coef`` (``algorithm.distill.coef``) times:

* ``"advantage"``: to the per-token advantages, before the policy loss (computed once per step from the
  student's old log-probs; the policy loss's ratio, clipping and rollout correction then apply as to any
  advantage);
* ``"loss"``: to the per-token loss of every micro-batch (computed from the student's current log-probs,
  with gradients), aggregated with the policy loss;

and whether it needs the teacher's top-k (``top_k``: ``algorithm.distill.top_k`` ids per token and the
student's log-probs at them) and whether it may train on the prompts' dataset responses instead of the
student's samples (``dataset_responses``: ``algorithm.distill.lmbda < 1``). The driver, the config checks and
the planner read that declaration and nothing else.

Notation: ``s_t = log pi_student(y_t)``, ``t_t = log pi_teacher(y_t)`` at the sampled token ``y_t``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import Tensor

from megarlhf.algorithms._checks import check_mask, check_shape, zero_masked
from megarlhf.config.distill import DistillConfig
from megarlhf.core.registry import Registry


@dataclass
class DistillInputs:
    response_mask: Tensor  # [B, T] 1 on response tokens
    student_logprobs: Tensor  # [B, T] s_t: old (an advantage term) or current with gradients (a loss term)
    teacher_logprobs: Tensor  # [B, T] t_t
    student_topk_logprobs: Tensor | None = None  # [B, T, K] the student's log-probs at the teacher's top-k ids
    teacher_topk_logprobs: Tensor | None = None  # [B, T, K] the teacher's top-k log-probs
    # [B, T] the log-probability outside those ids, each model's (summed from the small terms themselves: 1 minus
    # the top-k's fp32 mass would lose a confident model's rest, :mod:`megarlhf.ops.topk_logprob`)
    student_topk_rest: Tensor | None = None
    teacher_topk_rest: Tensor | None = None
    covers_vocabulary: bool = False  # K is the whole vocabulary: no probability lies outside the top-k

    def __post_init__(self):
        where = "DistillInputs"
        self.response_mask = check_mask(where, "response_mask", self.response_mask)
        shape = tuple(self.response_mask.shape)
        check_shape(where, "student_logprobs", self.student_logprobs, shape)
        check_shape(where, "teacher_logprobs", self.teacher_logprobs, shape)
        if (self.student_topk_logprobs is None) != (self.teacher_topk_logprobs is None):
            raise ValueError(f"{where}: student_topk_logprobs and teacher_topk_logprobs go together")
        if self.teacher_topk_logprobs is not None:
            k = self.teacher_topk_logprobs.shape[-1]
            check_shape(where, "teacher_topk_logprobs", self.teacher_topk_logprobs, (*shape, k))
            check_shape(where, "student_topk_logprobs", self.student_topk_logprobs, (*shape, k))
            if not self.covers_vocabulary and (self.student_topk_rest is None or self.teacher_topk_rest is None):
                raise ValueError(f"{where}: a top-k short of the vocabulary needs both models' rest log-probabilities")
            check_shape(where, "student_topk_rest", self.student_topk_rest, shape)
            check_shape(where, "teacher_topk_rest", self.teacher_topk_rest, shape)


@dataclass(frozen=True)
class DistillNeeds:
    """Where a term enters the RL step and what it needs (module docstring)."""

    enters: Literal["advantage", "loss"]
    top_k: bool = False
    dataset_responses: bool = False


@dataclass(frozen=True)
class DistillTerm:
    fn: Callable[[DistillInputs, DistillConfig], Tensor]
    needs: DistillNeeds

    def __call__(self, inputs: DistillInputs, config: DistillConfig) -> Tensor:
        return self.fn(inputs, config)


DISTILL_LOSSES: Registry[DistillTerm] = Registry("distillation loss")


def distill_needs(name: str) -> DistillNeeds:
    """What the term registered as ``name`` declared."""
    return DISTILL_LOSSES.get(name).needs


def distills_into(config, where: str) -> DistillTerm | None:
    """The run's distillation term (``config``: a RunConfig) when it enters ``where`` ("advantage" or "loss"),
    else None."""
    distill = config.algorithm.distill
    if distill is None or DISTILL_LOSSES.get(distill.loss).needs.enters != where:
        return None
    return DISTILL_LOSSES.get(distill.loss)


def _term(name: str, **needs):
    def add(fn):
        DISTILL_LOSSES.register(name)(DistillTerm(fn, DistillNeeds(**needs)))
        return fn

    return add


@_term("reverse_kl", enters="advantage")
def reverse_kl(inputs: DistillInputs, config: DistillConfig) -> Tensor:
    """On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes"; Thinking Machines 2025, "On-Policy Distillation"): the per-token advantage
    ``A_t = t_t - s_t``, minus the single-sample estimate of the reverse KL(student || teacher) at token t.
    The policy gradient of ``sum_t A_t log pi(y_t)`` over the student's own samples descends the reverse KL,
    token by token, with no discounting: each token is credited with its own divergence only.
    """
    mask = inputs.response_mask
    return zero_masked(inputs.teacher_logprobs.detach() - inputs.student_logprobs.detach(), mask)


def _with_rest(logprobs: Tensor, rest: Tensor | None) -> Tensor:
    """[..., K] log-probs of K tokens and the log-probability outside them [...] -> [..., K + 1] in float64 (no
    extra category where the K cover the vocabulary: ``rest`` None)."""
    logprobs = logprobs.double()
    if rest is None:
        return logprobs
    return torch.cat([logprobs, rest.double().clamp(min=-700.0)[..., None]], dim=-1)


def _kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL(p || q) over the last dimension, from log-probabilities."""
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


@_term("gkd", enters="loss", top_k=True, dataset_responses=True)
def gkd(inputs: DistillInputs, config: DistillConfig) -> Tensor:
    """GKD's generalized Jensen-Shannon divergence (Agarwal et al. 2024, Eq. 1, as TRL 1.16's ``GKDTrainer``
    computes it) per response token, between the student S and the teacher T at that position:

    ``JSD_beta = beta KL(T || M) + (1 - beta) KL(S || M)``, ``M = beta T + (1 - beta) S``;
    ``beta = 0`` is KL(T || S) (forward), ``beta = 1`` is KL(S || T) (reverse).

    The distributions are the teacher's top-k tokens plus one category for the rest of the vocabulary
    (T's and S's remaining mass): exactly TRL's full-vocabulary divergence when k covers the vocabulary, and a
    lower bound of it otherwise (merging categories never raises a divergence). The teacher's side is
    constant; the gradient flows through the student's log-probs at the teacher's ids.
    """
    if inputs.teacher_topk_logprobs is None:
        raise ValueError("gkd needs the teacher's top-k log-probs (algorithm.distill.top_k >= 1)")
    full = inputs.covers_vocabulary
    student = _with_rest(inputs.student_topk_logprobs, None if full else inputs.student_topk_rest)
    teacher = _with_rest(inputs.teacher_topk_logprobs.detach(), None if full else inputs.teacher_topk_rest.detach())
    beta = float(config.beta)
    if beta == 0.0:
        jsd = _kl(teacher, student)
    elif beta == 1.0:
        jsd = _kl(student, teacher)
    else:
        mixture = torch.logsumexp(torch.stack([student + math.log1p(-beta), teacher + math.log(beta)]), dim=0)
        jsd = beta * _kl(teacher, mixture) + (1.0 - beta) * _kl(student, mixture)
    mask = inputs.response_mask
    return zero_masked(jsd.to(inputs.student_topk_logprobs.dtype), mask)
