"""Distillation terms against hand-worked numbers and TRL 1.16's GKDTrainer.generalized_jsd_loss."""
from __future__ import annotations

import math

import pytest
import torch

from megarlhf.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, estimator_needs
from megarlhf.algorithms.distillation import DISTILL_LOSSES, DistillInputs, distill_needs
from megarlhf.config.algorithm import AdvantageConfig
from megarlhf.config.distill import DistillConfig


def test_reverse_kl_advantage_by_hand():
    """Two samples, three positions; the second sample's last position is padding (NaN must not leak)."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    student = torch.tensor([[-0.7, -0.2, -2.0], [-0.1, -3.0, float("nan")]])
    teacher = torch.tensor([[-0.5, -1.2, -2.0], [-0.4, -0.5, float("nan")]])
    got = DISTILL_LOSSES.get("reverse_kl")(DistillInputs(mask, student, teacher), DistillConfig())
    # A_t = t_t - s_t: (-0.5) - (-0.7) = 0.2; (-1.2) - (-0.2) = -1.0; 0; (-0.4) - (-0.1) = -0.3; 2.5; padding 0
    assert torch.allclose(got, torch.tensor([[0.2, -1.0, 0.0], [-0.3, 2.5, 0.0]]), atol=1e-6)
    assert distill_needs("reverse_kl").enters == "advantage" and not distill_needs("reverse_kl").top_k


def _trl_jsd(student_logits, teacher_logits, beta):
    from trl.experimental.gkd import GKDTrainer

    labels = torch.zeros(student_logits.shape[:2], dtype=torch.long)
    return GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels, beta=beta, reduction="none")


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_gkd_over_the_whole_vocabulary_is_trl_generalized_jsd(beta):
    """With k = the vocabulary the term is TRL's per-token divergence (summed over the vocabulary)."""
    gen = torch.Generator().manual_seed(3)
    student_logits = torch.randn(2, 5, 11, generator=gen, dtype=torch.float64) * 2
    teacher_logits = torch.randn(2, 5, 11, generator=gen, dtype=torch.float64) * 2
    mask = torch.ones(2, 5, dtype=torch.bool)
    s, t = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    order = torch.argsort(t, dim=-1, descending=True)  # the teacher's top-k order, as the op returns it
    inputs = DistillInputs(mask, s[..., 0], t[..., 0], s.gather(-1, order), t.gather(-1, order),
                           covers_vocabulary=True)
    got = DISTILL_LOSSES.get("gkd")(inputs, DistillConfig(loss="gkd", top_k=11, beta=beta))
    want = _trl_jsd(student_logits, teacher_logits, beta).sum(-1)  # TRL's elementwise terms, summed over the vocab
    assert torch.allclose(got, want.reshape(2, 5), atol=1e-12, rtol=1e-10)


def test_gkd_top_k_with_the_rest_of_the_vocabulary_by_hand():
    """Teacher (0.5, 0.3 | 0.2 rest), student (0.25, 0.25 | 0.5 rest), beta 0.5: by hand over three categories."""
    t = torch.log(torch.tensor([[[0.5, 0.3]]], dtype=torch.float64))
    s = torch.log(torch.tensor([[[0.25, 0.25]]], dtype=torch.float64))
    mask = torch.ones(1, 1, dtype=torch.bool)
    inputs = DistillInputs(mask, s[..., 0], t[..., 0], s, t)
    got = float(DISTILL_LOSSES.get("gkd")(inputs, DistillConfig(loss="gkd", top_k=2, beta=0.5)))
    p, q = [0.5, 0.3, 0.2], [0.25, 0.25, 0.5]
    m = [(a + b) / 2 for a, b in zip(p, q)]
    want = 0.5 * sum(a * math.log(a / c) for a, c in zip(p, m)) + 0.5 * sum(b * math.log(b / c) for b, c in zip(q, m))
    assert got == pytest.approx(want, rel=1e-12)
    # forward and reverse KL over the same three categories
    forward = float(DISTILL_LOSSES.get("gkd")(inputs, DistillConfig(loss="gkd", top_k=2, beta=0.0)))
    assert forward == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q)), rel=1e-12)
    reverse = float(DISTILL_LOSSES.get("gkd")(inputs, DistillConfig(loss="gkd", top_k=2, beta=1.0)))
    assert reverse == pytest.approx(sum(b * math.log(b / a) for a, b in zip(p, q)), rel=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gkd_top_k_bounds_the_full_divergence_from_below(beta):
    gen = torch.Generator().manual_seed(5)
    student_logits = torch.randn(3, 4, 50, generator=gen, dtype=torch.float64) * 3
    teacher_logits = torch.randn(3, 4, 50, generator=gen, dtype=torch.float64) * 3
    s, t = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    full = _trl_jsd(student_logits, teacher_logits, beta).sum(-1).reshape(3, 4)
    mask = torch.ones(3, 4, dtype=torch.bool)
    previous = torch.zeros_like(full)
    for k in (1, 5, 20, 49):
        ids = torch.topk(t, k, dim=-1).indices
        got = DISTILL_LOSSES.get("gkd")(DistillInputs(mask, s[..., 0], t[..., 0], s.gather(-1, ids), t.gather(-1, ids)),
                                        DistillConfig(loss="gkd", top_k=k, beta=beta))
        assert (got <= full + 1e-9).all() and (got >= previous - 1e-9).all()  # more categories, more divergence
        previous = got
    assert torch.allclose(previous, full, rtol=1e-3)  # 49 of 50 tokens plus the rest: the 50 categories


def test_gkd_gradients_are_finite_with_padding_and_vanishing_tails():
    """Padding rows hold zeros (log-probs summing past 1) and a row whose top-k holds all its mass: no NaN in
    the loss or its gradient, and padding gets no gradient."""
    student = torch.tensor([[[math.log(0.6), math.log(0.4 - 1e-15)], [0.0, 0.0]]], dtype=torch.float32,
                           requires_grad=True)
    teacher = torch.log(torch.tensor([[[0.7, 0.3], [0.5, 0.5]]]))
    mask = torch.tensor([[True, False]])
    loss = DISTILL_LOSSES.get("gkd")(DistillInputs(mask, student[..., 0].detach(), teacher[..., 0], student, teacher),
                                     DistillConfig(loss="gkd", top_k=2, beta=0.5))
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(student.grad).all()
    assert not student.grad[0, 1].any() and student.grad[0, 0].abs().sum() > 0
    assert distill_needs("gkd").enters == "loss" and distill_needs("gkd").top_k and distill_needs("gkd").dataset_responses


def test_inputs_checked():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="teacher_logprobs has shape"):
        DistillInputs(mask, torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="go together"):
        DistillInputs(mask, torch.zeros(2, 3), torch.zeros(2, 3), student_topk_logprobs=torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="student_topk_logprobs has shape"):
        DistillInputs(mask, torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3, 4), torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="top-k"):
        DISTILL_LOSSES.get("gkd")(DistillInputs(mask, torch.zeros(2, 3), torch.zeros(2, 3)), DistillConfig(loss="gkd"))


def test_estimator_none_gives_no_advantage_and_reads_no_reward():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    out = ADVANTAGE_ESTIMATORS.get("none")(AdvantageInputs(torch.tensor([1.0, 0.0]), mask), AdvantageConfig())
    assert not out.advantages.any() and not out.returns.any() and out.advantages.shape == (2, 3)
    assert not estimator_needs("none").rewards and estimator_needs("grpo").rewards


@pytest.mark.parametrize("bad", [{"coef": 0.0}, {"coef": float("nan")}, {"top_k": -1}, {"beta": 1.5}, {"lmbda": -0.1},
                                 {"top_k": True}, {"loss": ""}])
def test_config_refuses(bad):
    with pytest.raises(ValueError, match="DistillConfig"):
        DistillConfig(**bad)
