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
    rests = torch.log(torch.tensor([[0.5]], dtype=torch.float64)), torch.log(torch.tensor([[0.2]], dtype=torch.float64))
    inputs = DistillInputs(mask, s[..., 0], t[..., 0], s, t, *rests)
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
        rests = [torch.logsumexp(x.scatter(-1, ids, float("-inf")), dim=-1) for x in (s, t)]
        got = DISTILL_LOSSES.get("gkd")(DistillInputs(mask, s[..., 0], t[..., 0], s.gather(-1, ids), t.gather(-1, ids),
                                                      *rests), DistillConfig(loss="gkd", top_k=k, beta=beta))
        assert (got <= full + 1e-9).all() and (got >= previous - 1e-9).all()  # more categories, more divergence
        previous = got
    assert torch.allclose(previous, full, rtol=1e-3)  # 49 of 50 tokens plus the rest: the 50 categories


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gkd_gradients_are_finite_with_padding_and_vanishing_rests(beta):
    """Padding positions hold zeros (log-probs summing past 1), and the ops floor a rest with no mass at log(fp32's
    tiny), ~-87.3: no NaN or inf in the loss or its gradient, and padding gets no gradient."""
    tiny = math.log(torch.finfo(torch.float32).tiny)
    student = torch.tensor([[[math.log(0.6), math.log(0.4)], [0.0, 0.0]]], requires_grad=True)
    student_rest = torch.tensor([[tiny, 0.0]], requires_grad=True)
    teacher = torch.log(torch.tensor([[[0.7, 0.3 - 1e-9], [0.5, 0.5]]]))
    teacher_rest = torch.tensor([[math.log(1e-9), 0.0]])
    mask = torch.tensor([[True, False]])
    loss = DISTILL_LOSSES.get("gkd")(DistillInputs(mask, student[..., 0].detach(), teacher[..., 0], student, teacher,
                                                   student_rest, teacher_rest),
                                     DistillConfig(loss="gkd", top_k=2, beta=beta))
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(student.grad).all() and torch.isfinite(student_rest.grad).all()
    assert not student.grad[0, 1].any() and student.grad[0, 0].abs().sum() > 0 and not student_rest.grad[0, 1]
    assert float(loss[0, 0].detach()) < 0.1  # the rests are 1e-38 and 1e-9: nothing like the 700 nats of a sentinel
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
    with pytest.raises(ValueError, match="needs both models' rest"):
        DistillInputs(mask, torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))


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


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gkd_from_the_ops_keeps_confident_models_rests(beta):
    """Confident models (logits of +-30: the teacher's top-1 log-prob rounds to 0 in fp32, its rest is ~1e-9):
    the teacher's top-k op and the student's log-prob op with a rest column feed GKD the rests summed from their
    own terms, so its loss and gradient equal a float64 reference on the same logits (1 minus the top-k's fp32 mass
    would have put 20-45x the loss there)."""
    from megarlhf.ops import LogprobOptions, logprob_entropy, topk_logprobs

    gen = torch.Generator().manual_seed(11)
    n, h, v, k = 6, 16, 50, 4
    hidden = torch.randn(n, h, generator=gen)
    teacher_w = torch.randn(v, h, generator=gen) * 5.0  # logits of std ~20, up to ~60
    student_w = 0.6 * teacher_w + torch.randn(v, h, generator=gen)
    labels = torch.randint(0, v, (n,), generator=gen)
    _, t_top, ids, t_rest = topk_logprobs(hidden, teacher_w, labels, None, k, LogprobOptions(chunk_size=16))
    assert (t_top[:, 0] > -1e-6).any() and (t_rest < -15).any()  # confident rows: the rest is below fp32's grain
    x = hidden.clone().requires_grad_()
    lp, _ = logprob_entropy(x, student_w, torch.cat([labels[:, None], ids], 1), None,
                            LogprobOptions(chunk_size=16, rest_from=1, compute_entropy=False))
    mask = torch.ones(1, n, dtype=torch.bool)
    term = DISTILL_LOSSES.get("gkd")
    config = DistillConfig(loss="gkd", top_k=k, beta=beta)
    got = term(DistillInputs(mask, lp[None, :, 0], t_top[None, :, 0], lp[None, :, 1:-1], t_top[None],
                             lp[None, :, -1], t_rest[None]), config)
    got.sum().backward()

    x64 = hidden.double().requires_grad_()
    s_all = torch.log_softmax(x64 @ student_w.double().t(), -1)
    t_all = torch.log_softmax(hidden.double() @ teacher_w.double().t(), -1)
    rests = [torch.logsumexp(a.scatter(1, ids, float("-inf")), -1) for a in (s_all, t_all)]
    want = term(DistillInputs(mask, s_all[None, :, 0], t_all[None, :, 0], s_all.gather(1, ids)[None],
                              t_all.gather(1, ids)[None], rests[0][None], rests[1][None]), config)
    want.sum().backward()
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-7), (got, want)
    assert torch.allclose(x.grad.double(), x64.grad, rtol=1e-3, atol=1e-6)
