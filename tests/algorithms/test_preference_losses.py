"""Preference losses (DPO / cDPO, IPO, SimPO) and the Bradley-Terry reward-model loss against hand-worked
values, hand-derived gradients and metrics, and against TRL 1.16's own code run on the same per-pair
log-probs in float64: ``DPOTrainer._compute_loss`` (sigmoid, ipo), ``CPOTrainer.cpo_loss`` (the cDPO
formula, simpo) and ``RewardTrainer.compute_loss``. TRL's methods are called on instances made with
``__new__`` that carry only the attributes those methods read, and a stand-in model whose per-token
log-probs (or scores) are the test's numbers; no trainer is built."""
from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from megarlhf.algorithms.preference_losses import (PREFERENCE_LOSSES, PreferenceLossInputs, UnpairedLossInputs,
                                                   bradley_terry_loss)
from megarlhf.config.preference import PreferenceLossConfig

F64 = torch.float64


def _t(values, grad=False):
    return torch.tensor(values, dtype=F64, requires_grad=grad)


def _sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def _softplus(x):  # -logsigmoid(-x) = log(1 + e^x)
    return math.log1p(math.exp(x))


def _close(tensor, expected, atol=1e-12):
    return torch.allclose(tensor.detach(), torch.tensor(expected, dtype=tensor.dtype).reshape(tensor.shape),
                          rtol=0, atol=atol)


def _run(name, config, chosen, rejected, len_w, len_l, ref_w=None, ref_l=None):
    """Runs loss ``name``; returns (output, d sum(loss) / d chosen_logps, d sum(loss) / d rejected_logps)."""
    logp_w, logp_l = _t(chosen, grad=True), _t(rejected, grad=True)
    inputs = PreferenceLossInputs(chosen_logps=logp_w, rejected_logps=logp_l, chosen_lengths=torch.tensor(len_w),
                                  rejected_lengths=torch.tensor(len_l),
                                  ref_chosen_logps=None if ref_w is None else _t(ref_w),
                                  ref_rejected_logps=None if ref_l is None else _t(ref_l))
    out = PREFERENCE_LOSSES.get(name)(inputs, config)
    out.loss.sum().backward()
    return out, logp_w.grad, logp_l.grad


def _metrics_are(out, expected):
    assert set(out.metrics) == set(expected)
    for key, value in expected.items():
        assert abs(out.metrics[key].item() - value) <= 1e-12, key
        assert not out.metrics[key].requires_grad


# -------------------------------------------------------------------------------------- hand-worked

DPO_CASE = dict(chosen=[-3.0, -6.0], rejected=[-5.0, -2.0], len_w=[2, 3], len_l=[4, 1],
                ref_w=[-4.0, -5.0], ref_l=[-5.0, -3.0])


def test_dpo_hand_worked():
    # beta 0.5. pair 0: rho_w = -3 + 4 = 1, rho_l = 0 -> h = 1, z = 0.5, loss = log(1 + e^-0.5)
    #           pair 1: rho_w = -6 + 5 = -1, rho_l = -2 + 3 = 1 -> h = -2, z = -1, loss = log(1 + e^1)
    out, g_w, g_l = _run("dpo", PreferenceLossConfig(beta=0.5), **DPO_CASE)
    assert _close(out.loss, [_softplus(-0.5), _softplus(1.0)])
    # d/dz -logsigmoid(z) = -sigmoid(-z); dz/dlogp_w = beta, dz/dlogp_l = -beta
    assert _close(g_w, [-0.5 * _sig(-0.5), -0.5 * _sig(1.0)])
    assert _close(g_l, [0.5 * _sig(-0.5), 0.5 * _sig(1.0)])
    # rewards beta * rho: chosen (0.5, -0.5), rejected (0, 0.5); margins (0.5, -1)
    _metrics_are(out, {"rewards/chosen": 0.0, "rewards/rejected": 0.25, "rewards/accuracy": 0.5,
                       "rewards/margin": -0.25, "logps/chosen": -4.5, "logps/rejected": -3.5})


def test_cdpo_label_smoothing_hand_worked_and_zero_is_plain_dpo():
    # eps 0.1, same z = (0.5, -1): loss = 0.9 log(1 + e^-z) + 0.1 log(1 + e^z);
    # dL/dz = -0.9 sigmoid(-z) + 0.1 sigmoid(z)
    out, g_w, g_l = _run("dpo", PreferenceLossConfig(beta=0.5, label_smoothing=0.1), **DPO_CASE)
    z = [0.5, -1.0]
    assert _close(out.loss, [0.9 * _softplus(-v) + 0.1 * _softplus(v) for v in z])
    dz = [-0.9 * _sig(-v) + 0.1 * _sig(v) for v in z]
    assert _close(g_w, [0.5 * d for d in dz]) and _close(g_l, [-0.5 * d for d in dz])
    plain, _, _ = _run("dpo", PreferenceLossConfig(beta=0.5, label_smoothing=0.0), **DPO_CASE)
    # 0 smoothing is exactly -logsigmoid(beta h), computed independently
    assert torch.equal(plain.loss, -torch.nn.functional.logsigmoid(0.5 * _t([1.0, -2.0])))


def test_ipo_hand_worked_length_averaged():
    # beta 0.25 -> target 1 / (2 beta) = 2.
    # pair 0: rho_w = 3 over 3 tokens -> 1, rho_l = -2 over 2 -> -1; h = 2, loss 0
    # pair 1: rho_w = 2 over 4 tokens -> 0.5, rho_l = 1 over 1 -> 1; h = -0.5, loss (-2.5)^2 = 6.25
    case = dict(chosen=[-1.0, -3.0], rejected=[-4.0, -1.0], len_w=[3, 4], len_l=[2, 1],
                ref_w=[-4.0, -5.0], ref_l=[-2.0, -2.0])
    out, g_w, g_l = _run("ipo", PreferenceLossConfig(beta=0.25), **case)
    assert _close(out.loss, [0.0, 6.25])
    # dL/dlogp_w = 2 (h - 2) / |y_w|, dL/dlogp_l = -2 (h - 2) / |y_l|
    assert _close(g_w, [0.0, 2 * -2.5 / 4]) and _close(g_l, [0.0, -2 * -2.5 / 1])
    _metrics_are(out, {"rewards/chosen": 0.75, "rewards/rejected": 0.0, "rewards/accuracy": 0.5,
                       "rewards/margin": 0.75, "logps/chosen": -2.0, "logps/rejected": -2.5})
    with pytest.raises(ValueError, match="'ipo' has no label smoothing"):
        _run("ipo", PreferenceLossConfig(beta=0.25, label_smoothing=0.1), **case)


SIMPO_CASE = dict(chosen=[-2.0, -9.0], rejected=[-6.0, -4.0], len_w=[4, 3], len_l=[3, 2])


def test_simpo_hand_worked_reference_free():
    # simpo_beta 2, gamma 0.5. pair 0: r_w = 2 * -2 / 4 = -1, r_l = 2 * -6 / 3 = -4, z = 3 - 0.5 = 2.5
    #                          pair 1: r_w = 2 * -9 / 3 = -6, r_l = 2 * -4 / 2 = -4, z = -2 - 0.5 = -2.5
    config = PreferenceLossConfig(simpo_beta=2.0, simpo_gamma=0.5)
    out, g_w, g_l = _run("simpo", config, **SIMPO_CASE)
    assert _close(out.loss, [_softplus(-2.5), _softplus(2.5)])
    # dL/dlogp_w = -(beta / |y_w|) sigmoid(-z), dL/dlogp_l = +(beta / |y_l|) sigmoid(-z)
    assert _close(g_w, [-0.5 * _sig(-2.5), -(2 / 3) * _sig(2.5)])
    assert _close(g_l, [(2 / 3) * _sig(-2.5), 1.0 * _sig(2.5)])
    _metrics_are(out, {"rewards/chosen": -3.5, "rewards/rejected": -4.0, "rewards/accuracy": 0.5,
                       "rewards/margin": 0.5, "logps/chosen": -5.5, "logps/rejected": -5.0})
    # the reference inputs (even NaN) and DPO's beta are not read
    with_ref, _, _ = _run("simpo", PreferenceLossConfig(simpo_beta=2.0, simpo_gamma=0.5, beta=7.0),
                          ref_w=[math.nan, 1.0], ref_l=[2.0, math.nan], **SIMPO_CASE)
    assert torch.equal(with_ref.loss, out.loss)
    smooth, _, _ = _run("simpo", PreferenceLossConfig(simpo_beta=2.0, simpo_gamma=0.5, label_smoothing=0.2),
                        **SIMPO_CASE)
    assert _close(smooth.loss, [0.8 * _softplus(-v) + 0.2 * _softplus(v) for v in (2.5, -2.5)])


def test_bradley_terry_hand_worked():
    # s_w - s_l - m: (2 - 1 - 0.5, 0.5 - 1.5 - 0, 1 - 1 - 0) = (0.5, -1, 0)
    s_w, s_l = _t([2.0, 0.5, 1.0], grad=True), _t([1.0, 1.5, 1.0], grad=True)
    margin = _t([0.5, 0.0, 0.0], grad=True)
    loss, metrics = bradley_terry_loss(s_w, s_l, margin)
    assert _close(loss, [_softplus(-0.5), _softplus(1.0), math.log(2.0)])
    loss.sum().backward()
    # dL/ds_w = -sigmoid(-x), dL/ds_l = +sigmoid(-x); the margin is a constant
    assert _close(s_w.grad, [-_sig(-0.5), -_sig(1.0), -0.5]) and _close(s_l.grad, [_sig(-0.5), _sig(1.0), 0.5])
    assert margin.grad is None
    # gaps (1, -1, 0): one strict win of three (the tie counts as wrong, the margin is not applied)
    expected = {"rm/accuracy": 1 / 3, "rm/chosen_score": 3.5 / 3, "rm/rejected_score": 3.5 / 3, "rm/margin": 0.0}
    assert set(metrics) == set(expected)
    assert all(abs(metrics[k].item() - v) <= 1e-12 and not metrics[k].requires_grad for k, v in expected.items())
    no_margin, _ = bradley_terry_loss(s_w.detach(), s_l.detach())
    assert _close(no_margin, [_softplus(-1.0), _softplus(1.0), math.log(2.0)])
    with pytest.raises(ValueError, match="margin has shape"):
        bradley_terry_loss(s_w, s_l, _t([0.0]))


# ------------------------------------------------------------------------ declarations and checks

def test_reference_declaration_matches_behaviour():
    assert PREFERENCE_LOSSES.names() == ["dpo", "ipo", "kto", "simpo"]
    assert [PREFERENCE_LOSSES.get(n).needs_reference for n in ("dpo", "ipo", "simpo", "kto")] == [True] * 2 + [
        False, True]
    assert [PREFERENCE_LOSSES.get(n).paired for n in ("dpo", "ipo", "simpo", "kto")] == [True] * 3 + [False]
    for name in [n for n in PREFERENCE_LOSSES if PREFERENCE_LOSSES.get(n).paired]:
        if not PREFERENCE_LOSSES.get(name).needs_reference:
            out, _, _ = _run(name, PreferenceLossConfig(), **SIMPO_CASE)
            assert bool(torch.isfinite(out.loss).all())
            continue
        with pytest.raises(ValueError, match=rf"'{name}' needs PreferenceLossInputs\.ref_chosen_logps"):
            _run(name, PreferenceLossConfig(), **SIMPO_CASE)
        with pytest.raises(ValueError, match=rf"'{name}' needs PreferenceLossInputs\.ref_rejected_logps"):
            _run(name, PreferenceLossConfig(), ref_w=[0.0, 0.0], **SIMPO_CASE)


def test_reference_is_a_constant_and_low_precision_is_promoted():
    ref_w = _t([-4.0, -5.0], grad=True)
    logp_w = torch.tensor([-3.0, -6.0], dtype=torch.bfloat16, requires_grad=True)
    inputs = PreferenceLossInputs(chosen_logps=logp_w, rejected_logps=torch.tensor([-5.0, -2.0]),
                                  chosen_lengths=torch.tensor([2, 3]), rejected_lengths=torch.tensor([4, 1]),
                                  ref_chosen_logps=ref_w, ref_rejected_logps=torch.tensor([-5.0, -3.0]))
    out = PREFERENCE_LOSSES.get("dpo")(inputs, PreferenceLossConfig(beta=0.5))
    out.loss.sum().backward()
    assert out.loss.dtype == F64 and ref_w.grad is None and logp_w.grad is not None
    assert _close(out.loss, [_softplus(-0.5), _softplus(1.0)])


@pytest.mark.parametrize("kwargs, match", [
    ({"beta": 0.0}, r"PreferenceLossConfig\.beta must be > 0"),
    ({"simpo_beta": -1.0}, r"PreferenceLossConfig\.simpo_beta must be > 0"),
    ({"label_smoothing": 0.5}, r"PreferenceLossConfig\.label_smoothing must be in \[0, 0\.5\)"),
    ({"label_smoothing": -0.1}, r"PreferenceLossConfig\.label_smoothing must be in"),
    ({"simpo_gamma": -0.1}, r"PreferenceLossConfig\.simpo_gamma must be >= 0"),
    ({"beta": "0.1"}, r"PreferenceLossConfig\.beta must be a finite number"),
    ({"simpo_gamma": math.inf}, r"PreferenceLossConfig\.simpo_gamma must be a finite number"),
])
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PreferenceLossConfig(**kwargs)


def test_input_errors_name_the_field():
    good = dict(chosen_logps=_t([-1.0, -2.0]), rejected_logps=_t([-1.0, -3.0]),
                chosen_lengths=torch.tensor([1, 2]), rejected_lengths=torch.tensor([3, 4]))
    with pytest.raises(ValueError, match=r"rejected_logps has shape \(3,\), expected \(2,\)"):
        PreferenceLossInputs(**{**good, "rejected_logps": _t([1.0, 2.0, 3.0])})
    # checked on the device (no host read per micro-batch): a RuntimeError on CPU, a device assert on a GPU
    with pytest.raises(RuntimeError, match=r"chosen_lengths and rejected_lengths must be >= 1"):
        PreferenceLossInputs(**{**good, "rejected_lengths": torch.tensor([2, 0])})
    with pytest.raises(ValueError, match="chosen_logps must be a 1-D"):
        PreferenceLossInputs(**{**good, "chosen_logps": _t([[-1.0, -2.0]])})
    with pytest.raises(ValueError, match="ref_chosen_logps must be a floating tensor"):
        PreferenceLossInputs(**good, ref_chosen_logps=torch.tensor([1, 2]))
    with pytest.raises(TypeError):  # keyword-only: a positional call cannot swap two [P] fields
        PreferenceLossInputs(*good.values())


# ------------------------------------------------------------------------------------------ vs TRL

class _StandInModel:
    """Answers any forward with fixed outputs (the fields the TRL method reads), in eval mode."""

    training = False

    def __init__(self, **outputs):
        self.outputs = outputs

    def __call__(self, **inputs):
        return SimpleNamespace(**self.outputs)


def _trl_dpo(loss_type, beta, logp_w, logp_l, ref_w, ref_l, len_w, len_l):
    """TRL 1.16 ``DPOTrainer._compute_loss`` on these per-pair log-probs. The stand-in model's per-token
    log-probs hold each sequence's sum in one position (TRL sums them); the completion mask gives IPO its
    lengths. Returns (mean loss, d loss / d logp_w, d loss / d logp_l, TRL's metrics)."""
    from trl.trainer.dpo_trainer import DPOTrainer

    pairs, width = len(logp_w), max(len_w + len_l) + 1
    per_token = torch.zeros(2 * pairs, width - 1, dtype=F64)
    per_token[:, 0] = torch.cat([logp_w, logp_l])
    per_token.requires_grad_(True)
    completion_mask = torch.zeros(2 * pairs, width, dtype=torch.long)
    for row, length in enumerate(len_w + len_l):
        completion_mask[row, width - length:] = 1
    flat = torch.zeros(2 * pairs, width - 1, dtype=F64)
    model = _StandInModel(log_probs=per_token, entropy=flat, mean_logits=flat, is_top1=flat.bool())
    trainer = DPOTrainer.__new__(DPOTrainer)
    vars(trainer).update(
        model=model, accelerator=SimpleNamespace(device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x),
        precompute_ref_logps=True, aux_loss_enabled=False, ld_alpha=None, f_divergence_type="reverse_kl",
        loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=0.0, use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(2 * pairs, width, dtype=torch.long), "completion_mask": completion_mask,
              "attention_mask": torch.ones(2 * pairs, width, dtype=torch.long),
              "ref_chosen_logps": ref_w, "ref_rejected_logps": ref_l}
    loss = trainer._compute_loss(model, inputs, False)
    loss.backward()
    grad = per_token.grad[:, 0]
    return loss, grad[:pairs], grad[pairs:], {k: v[-1] for k, v in trainer._metrics["eval"].items()}


def _trl_cpo(loss_type, beta, label_smoothing, chosen, rejected, simpo_gamma=0.0):
    """TRL 1.16 ``CPOTrainer.cpo_loss``: per-pair losses and (chosen, rejected) rewards."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    trainer = CPOTrainer.__new__(CPOTrainer)
    vars(trainer).update(alpha=0.0, loss_type=loss_type, beta=beta, label_smoothing=label_smoothing,
                         simpo_gamma=simpo_gamma, accelerator=SimpleNamespace(device="cpu"))
    return trainer.cpo_loss(chosen, rejected)


def _random_pairs(pairs=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    len_w = torch.randint(1, 20, (pairs,), generator=gen)
    len_l = torch.randint(1, 20, (pairs,), generator=gen)
    logps = [-(torch.rand(pairs, generator=gen, dtype=F64) * 3 + 0.1) * n for n in (len_w, len_l, len_w, len_l)]
    return len_w, len_l, logps


def _ours(name, config, len_w, len_l, logps, with_ref=True):
    logp_w, logp_l = logps[0].clone().requires_grad_(True), logps[1].clone().requires_grad_(True)
    inputs = PreferenceLossInputs(chosen_logps=logp_w, rejected_logps=logp_l, chosen_lengths=len_w,
                                  rejected_lengths=len_l, ref_chosen_logps=logps[2] if with_ref else None,
                                  ref_rejected_logps=logps[3] if with_ref else None)
    out = PREFERENCE_LOSSES.get(name)(inputs, config)
    out.loss.mean().backward()
    return out, logp_w.grad, logp_l.grad


def _max_diff(a, b):
    return (torch.as_tensor(a, dtype=F64) - torch.as_tensor(b, dtype=F64)).abs().max().item()


@pytest.mark.parametrize("name, beta", [("dpo", 0.1), ("dpo", 0.37), ("ipo", 0.1), ("ipo", 0.5)])
def test_dpo_and_ipo_match_trl_dpo_trainer(name, beta):
    len_w, len_l, logps = _random_pairs(seed=int(beta * 100))
    ours, g_w, g_l = _ours(name, PreferenceLossConfig(beta=beta), len_w, len_l, logps)
    loss, t_w, t_l, trl_metrics = _trl_dpo("sigmoid" if name == "dpo" else "ipo", beta, *logps,
                                           len_w.tolist(), len_l.tolist())
    assert _max_diff(ours.loss.mean(), loss) <= 1e-6 and _max_diff(g_w, t_w) <= 1e-6 and _max_diff(g_l, t_l) <= 1e-6
    for i in range(len(len_w)):  # per pair: TRL on one pair at a time
        one, _, _, _ = _trl_dpo("sigmoid" if name == "dpo" else "ipo", beta, *(x[i:i + 1] for x in logps),
                                [len_w[i].item()], [len_l[i].item()])
        assert _max_diff(ours.loss[i], one) <= 1e-6
    if name == "dpo":  # same implicit reward beta * rho, so the same metrics
        for ours_key, trl_key in (("rewards/chosen", "rewards/chosen"), ("rewards/rejected", "rewards/rejected"),
                                  ("rewards/accuracy", "rewards/accuracies"), ("rewards/margin", "rewards/margins"),
                                  ("logps/chosen", "logps/chosen"), ("logps/rejected", "logps/rejected")):
            assert _max_diff(ours.metrics[ours_key], trl_metrics[trl_key]) <= 1e-6, ours_key


@pytest.mark.parametrize("eps", [0.1, 0.3])
def test_cdpo_matches_trl_label_smoothed_sigmoid(eps):
    # TRL 1.16's DPOTrainer sigmoid loss has no label smoothing; CPOTrainer.cpo_loss("sigmoid") computes
    # -(1 - eps) logsigmoid(beta x) - eps logsigmoid(-beta x) on x = chosen - rejected: given the
    # log-ratios rho_w and rho_l, x is DPO's h and the line is cDPO.
    len_w, len_l, logps = _random_pairs(seed=7)
    ours, _, _ = _ours("dpo", PreferenceLossConfig(beta=0.2, label_smoothing=eps), len_w, len_l, logps)
    trl_loss, _, _ = _trl_cpo("sigmoid", 0.2, eps, logps[0] - logps[2], logps[1] - logps[3])
    assert _max_diff(ours.loss, trl_loss) <= 1e-6


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_simpo_matches_trl_cpo_simpo(eps):
    # TRL's CPO computes SimPO on length-averaged log-probs (average_log_prob=True for "simpo")
    len_w, len_l, logps = _random_pairs(seed=11)
    config = PreferenceLossConfig(simpo_beta=2.5, simpo_gamma=1.375, label_smoothing=eps)
    ours, _, _ = _ours("simpo", config, len_w, len_l, logps, with_ref=False)
    trl_loss, trl_w, trl_l = _trl_cpo("simpo", 2.5, eps, logps[0] / len_w, logps[1] / len_l, simpo_gamma=1.375)
    assert _max_diff(ours.loss, trl_loss) <= 1e-6
    assert _max_diff(ours.metrics["rewards/chosen"], trl_w.mean()) <= 1e-6
    assert _max_diff(ours.metrics["rewards/rejected"], trl_l.mean()) <= 1e-6


@pytest.mark.parametrize("with_margin", [False, True])
def test_bradley_terry_matches_trl_reward_trainer(with_margin):
    from trl.trainer.reward_trainer import RewardTrainer

    gen = torch.Generator().manual_seed(3)
    s_w, s_l, margin = (torch.randn(8, generator=gen, dtype=F64) for _ in range(3))
    scores = torch.cat([s_w, s_l])[:, None]
    model = _StandInModel(logits=scores)
    trainer = RewardTrainer.__new__(RewardTrainer)
    vars(trainer).update(model=model, args=SimpleNamespace(center_rewards_coefficient=None),
                         accelerator=SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x),
                         _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                         _total_train_tokens=0, _tp_size=1)
    inputs = {"attention_mask": torch.ones(16, 4, dtype=torch.long)}
    if with_margin:
        inputs["margin"] = margin
    trl_loss = trainer.compute_loss(model, inputs)
    loss, metrics = bradley_terry_loss(s_w, s_l, margin if with_margin else None)
    assert _max_diff(loss.mean(), trl_loss) <= 1e-6
    assert _max_diff(metrics["rm/accuracy"], trainer._metrics["eval"]["accuracy"][-1]) <= 1e-6
    assert _max_diff(metrics["rm/margin"], trainer._metrics["eval"]["margin"][-1]) <= 1e-6


# ----------------------------------------------------------------------------------------------- KTO

KTO_CASE = dict(logps=[-3.0, -6.0, -2.0, -5.0], ref=[-4.0, -5.0, -2.5, -5.5], desirable=[True, False, True, False])


def _kto(config, logps, ref, desirable, z0):
    logp = _t(logps, grad=True)
    out = PREFERENCE_LOSSES.get("kto")(UnpairedLossInputs(
        logps=logp, lengths=torch.tensor([2, 3, 1, 4]), desirable=torch.tensor(desirable), ref_logps=_t(ref),
        kl_baseline=_t(z0)), config)
    out.loss.sum().backward()
    return out, logp.grad


def test_kto_hand_worked():
    # rho = logp - ref = [1, -1, 0.5, 0.5]; beta 0.5, z0 0.2, desirable weight 2, undesirable weight 1.5
    config = PreferenceLossConfig(beta=0.5, desirable_weight=2.0, undesirable_weight=1.5)
    out, grad = _kto(config, **KTO_CASE, z0=0.2)
    expected = [2 * (1 - _sig(0.5 * 0.8)), 1.5 * (1 - _sig(0.5 * 1.2)), 2 * (1 - _sig(0.5 * 0.3)),
                1.5 * (1 - _sig(0.5 * -0.3))]
    assert _close(out.loss, expected)
    # d/drho of w (1 - sig(beta (rho - z0))) = -w beta sig' ; of w (1 - sig(beta (z0 - rho))) = +w beta sig'
    dsig = lambda x: _sig(x) * (1 - _sig(x))  # noqa: E731
    assert _close(grad, [-2 * 0.5 * dsig(0.4), 1.5 * 0.5 * dsig(0.6), -2 * 0.5 * dsig(0.15), 1.5 * 0.5 * dsig(-0.15)])
    assert _close(out.metrics["rewards/chosen"], (0.5 * 1 + 0.5 * 0.5) / 2)
    assert _close(out.metrics["rewards/rejected"], (0.5 * -1 + 0.5 * 0.5) / 2)
    assert _close(out.metrics["logps/chosen"], -2.5) and _close(out.metrics["logps/rejected"], -5.5)
    assert [float(out.counts[k]) for k in ("rewards/chosen", "rewards/rejected")] == [2.0, 2.0]


def test_kto_baseline_is_a_constant_and_one_label_batches_count_right():
    z0 = _t(0.3, grad=True)
    logp = _t([-1.0, -2.0], grad=True)
    out = PREFERENCE_LOSSES.get("kto")(UnpairedLossInputs(
        logps=logp, lengths=torch.tensor([1, 1]), desirable=torch.tensor([True, True]), ref_logps=_t([-1.5, -2.0]),
        kl_baseline=z0), PreferenceLossConfig())
    out.loss.sum().backward()
    assert z0.grad is None and float(out.counts["rewards/rejected"]) == 0.0
    assert float(out.metrics["rewards/rejected"]) == 0.0  # no undesirable row: 0, counted over 0 rows


def test_kto_input_errors_name_the_field():
    good = dict(logps=_t([-1.0]), lengths=torch.tensor([1]), desirable=torch.tensor([True]))
    with pytest.raises(ValueError, match="desirable must be a bool tensor"):
        UnpairedLossInputs(**{**good, "desirable": torch.tensor([1])})
    with pytest.raises(ValueError, match="kl_baseline must be a scalar"):
        UnpairedLossInputs(**good, kl_baseline=_t([0.1, 0.2]))
    with pytest.raises(ValueError, match=r"'kto' needs UnpairedLossInputs\.ref_logps"):
        PREFERENCE_LOSSES.get("kto")(UnpairedLossInputs(**good, kl_baseline=_t(0.0)), PreferenceLossConfig())
    with pytest.raises(ValueError, match=r"'kto' needs UnpairedLossInputs\.kl_baseline"):
        PREFERENCE_LOSSES.get("kto")(UnpairedLossInputs(**good, ref_logps=_t([0.0])), PreferenceLossConfig())
    with pytest.raises(ValueError, match="'kto' has no label smoothing"):
        PREFERENCE_LOSSES.get("kto")(UnpairedLossInputs(**good, ref_logps=_t([0.0]), kl_baseline=_t(0.0)),
                                     PreferenceLossConfig(label_smoothing=0.1))
    with pytest.raises(TypeError, match="reads UnpairedLossInputs"):
        PREFERENCE_LOSSES.get("kto")(PreferenceLossInputs(
            chosen_logps=_t([-1.0]), rejected_logps=_t([-1.0]), chosen_lengths=torch.tensor([1]),
            rejected_lengths=torch.tensor([1])), PreferenceLossConfig())
    with pytest.raises(ValueError, match=r"PreferenceLossConfig\.undesirable_weight must be > 0"):
        PreferenceLossConfig(undesirable_weight=0.0)
