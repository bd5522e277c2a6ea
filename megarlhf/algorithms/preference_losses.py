"""Preference losses (DPO, IPO, SimPO on pairs; KTO on unpaired rows) on sequence log-probs, and the
Bradley-Terry reward-model loss.

Every preference loss is registered in :data:`PREFERENCE_LOSSES` with one signature::

    loss_fn(inputs, config: PreferenceLossConfig) -> PreferenceLossOutput

and declares what it needs: the frozen reference model (:attr:`PreferenceLoss.needs_reference`; the
trainer builds and runs one only for the losses that declare it, and a loss that needs one refuses
inputs without its log-probs, naming the missing field), and whether it reads preference *pairs*
(:attr:`PreferenceLoss.paired`: ``inputs`` is a :class:`PreferenceLossInputs`, the data rows hold a
prompt, a chosen and a rejected response) or *unpaired* rows (``inputs`` is an
:class:`UnpairedLossInputs`, the rows hold a prompt, one completion and a desirable/undesirable label).

Notation, for pair ``i`` of a call with ``P`` pairs: ``y_w`` the chosen and ``y_l`` the rejected
response; ``logp_w = log pi(y_w|x)`` summed over the response tokens under the policy (with grad),
``ref_w`` the same under the reference model (a constant: detached here); ``|y_w|`` the number of
response tokens; ``rho_w = logp_w - ref_w`` the log-ratio; the same with ``l`` for the rejected side.

``PreferenceLossOutput.loss`` is the loss of each pair (or unpaired row) [P]; the trainer averages it
over the global batch (the reduction is not done here so that the mean is over every pair of the step under
gradient accumulation and data parallelism). ``metrics`` are detached means over the pairs of this
call: ``rewards/chosen`` and ``rewards/rejected`` (the loss's implicit reward ``r(x, y)``, whose
chosen-minus-rejected difference is what the loss acts on; each docstring says what it is),
``rewards/accuracy`` (the fraction of pairs with ``r_w > r_l``, ties count as wrong),
``rewards/margin`` (mean ``r_w - r_l``) and ``logps/chosen`` / ``logps/rejected`` (mean summed policy
log-probs). An unpaired loss's means run over the rows of one label each (``rewards/chosen`` over the
desirable rows, ...), and :attr:`PreferenceLossOutput.counts` says over how many, so that the trainer
weights them right when it averages over micro-batches and ranks. Computations run in the inputs'
promoted floating dtype, at least float32.

Each function's docstring states its formula (TRL's losses live inside its trainers' forward, so they are
not reused).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from megarlhf.algorithms._checks import check_shape, compute_dtype
from megarlhf.core.registry import Registry
from megarlhf.config.preference import PreferenceLossConfig


@dataclass(kw_only=True)
class PreferenceLossInputs:
    """Per-pair sequence log-probs (summed over response tokens) and response lengths, all [P]; keyword
    arguments only, because every field is a [P] tensor and a swapped positional one would go unnoticed."""

    chosen_logps: Tensor  # policy log pi(y_w|x), with grad
    rejected_logps: Tensor  # policy log pi(y_l|x), with grad
    chosen_lengths: Tensor  # response tokens of y_w, >= 1
    rejected_lengths: Tensor  # response tokens of y_l, >= 1
    ref_chosen_logps: Tensor | None = None  # reference log pi_ref(y_w|x): constants (detached)
    ref_rejected_logps: Tensor | None = None

    def __post_init__(self):
        where = "PreferenceLossInputs"
        if not isinstance(self.chosen_logps, Tensor) or self.chosen_logps.dim() != 1:
            shape = tuple(self.chosen_logps.shape) if isinstance(self.chosen_logps, Tensor) else \
                type(self.chosen_logps).__name__
            raise ValueError(f"{where}: chosen_logps must be a 1-D [P] tensor, got {shape}")
        if self.chosen_logps.shape[0] == 0:
            raise ValueError(f"{where}: no pairs (chosen_logps is empty)")
        shape = tuple(self.chosen_logps.shape)
        for name in ("rejected_logps", "chosen_lengths", "rejected_lengths", "ref_chosen_logps",
                     "ref_rejected_logps"):
            check_shape(where, name, getattr(self, name), shape)
        for name in ("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps"):
            tensor = getattr(self, name)
            if tensor is not None and not tensor.is_floating_point():
                raise ValueError(f"{where}: {name} must be a floating tensor, got {tensor.dtype}")
        # Checked on the device without reading it back (the trainer builds these per micro-batch; a read
        # would stall a GPU's queue): on CPU a violation raises here, on a GPU the assertion fails the device.
        torch._assert_async(((self.chosen_lengths >= 1) & (self.rejected_lengths >= 1)).all(),
                            f"{where}: chosen_lengths and rejected_lengths must be >= 1 (response tokens)")


@dataclass(kw_only=True)
class UnpairedLossInputs:
    """Per-row sequence log-probs of unpaired rows, all [P] (keyword arguments only), and the KL baseline.

    ``kl_baseline`` is KTO's reference point ``z0``: an estimate of ``KL(pi || pi_ref)`` over the step's
    rows, a detached scalar the same for every row of the step (the trainer computes it over the whole
    global batch: :func:`megarlhf.learner.preference.kl_baseline`)."""

    logps: Tensor  # policy log pi(y|x), summed over the response tokens, with grad
    lengths: Tensor  # response tokens of y, >= 1
    desirable: Tensor  # bool: True for a desirable row, False for an undesirable one
    ref_logps: Tensor | None = None  # reference log pi_ref(y|x): constants (detached)
    kl_baseline: Tensor | None = None  # scalar z0 >= 0 (detached)

    def __post_init__(self):
        where = "UnpairedLossInputs"
        if not isinstance(self.logps, Tensor) or self.logps.dim() != 1 or self.logps.shape[0] == 0:
            raise ValueError(f"{where}: logps must be a non-empty 1-D [P] tensor")
        shape = tuple(self.logps.shape)
        for name in ("lengths", "desirable", "ref_logps"):
            check_shape(where, name, getattr(self, name), shape)
        if self.desirable.dtype != torch.bool:
            raise ValueError(f"{where}: desirable must be a bool tensor, got {self.desirable.dtype}")
        for name in ("logps", "ref_logps", "kl_baseline"):
            tensor = getattr(self, name)
            if tensor is not None and not tensor.is_floating_point():
                raise ValueError(f"{where}: {name} must be a floating tensor, got {tensor.dtype}")
        if self.kl_baseline is not None and self.kl_baseline.numel() != 1:
            raise ValueError(f"{where}: kl_baseline must be a scalar, got shape {tuple(self.kl_baseline.shape)}")
        torch._assert_async((self.lengths >= 1).all(), f"{where}: lengths must be >= 1 (response tokens)")


@dataclass
class PreferenceLossOutput:
    loss: Tensor  # [P] per-pair (or per-row) loss
    metrics: dict[str, Tensor] = field(default_factory=dict)  # detached scalars, means over the pairs
    # for a metric averaged over only some rows (an unpaired loss's per-label means): how many [scalar];
    # a metric not named here is a mean over all P
    counts: dict[str, Tensor] = field(default_factory=dict)


PreferenceLossFn = Callable[[PreferenceLossInputs | UnpairedLossInputs, PreferenceLossConfig], PreferenceLossOutput]

PAIRED_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin", "logps/chosen",
                  "logps/rejected")
UNPAIRED_METRICS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


@dataclass(frozen=True)
class PreferenceLoss:
    """A registered preference loss: the function, whether it needs the reference model's log-probs,
    whether it reads pairs or unpaired rows, and the metrics it reports; calling it calls the function."""

    fn: PreferenceLossFn
    needs_reference: bool
    paired: bool = True
    label_smoothing: bool = True  # reads PreferenceLossConfig.label_smoothing (False: refuses a non-zero one)

    @property
    def metrics(self) -> tuple[str, ...]:
        return PAIRED_METRICS if self.paired else UNPAIRED_METRICS

    def __call__(self, inputs, config: PreferenceLossConfig) -> PreferenceLossOutput:
        expected = PreferenceLossInputs if self.paired else UnpairedLossInputs
        if not isinstance(inputs, expected):
            raise TypeError(f"preference loss {self.fn.__name__!r} reads {expected.__name__}, got "
                            f"{type(inputs).__name__}")
        return self.fn(inputs, config)


PREFERENCE_LOSSES: Registry[PreferenceLoss] = Registry("preference loss")


def _preference_loss(name: str, needs_reference: bool, paired: bool = True, label_smoothing: bool = True):
    """Registers the decorated function under ``name`` with its declarations."""
    def add(fn):
        PREFERENCE_LOSSES.register(name)(PreferenceLoss(fn, needs_reference, paired, label_smoothing))
        return fn

    return add


# ---------------------------------------------------------------------------------------------- helpers

def _policy(inputs: PreferenceLossInputs) -> tuple[Tensor, Tensor, torch.dtype]:
    """(logp_w, logp_l) in the compute dtype (with grad), and that dtype."""
    dtype = compute_dtype(inputs.chosen_logps, inputs.rejected_logps, inputs.ref_chosen_logps,
                          inputs.ref_rejected_logps)
    return inputs.chosen_logps.to(dtype), inputs.rejected_logps.to(dtype), dtype


def _reference(inputs: PreferenceLossInputs, loss: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(ref_w, ref_l) detached; raises naming the field if the loss needs it and it is None."""
    out = []
    for name in ("ref_chosen_logps", "ref_rejected_logps"):
        tensor = getattr(inputs, name)
        if tensor is None:
            raise ValueError(f"preference loss {loss!r} needs PreferenceLossInputs.{name} (the reference "
                             f"model's log-probs), which is None")
        out.append(tensor.detach().to(dtype))
    return out[0], out[1]


def _lengths(inputs: PreferenceLossInputs, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return inputs.chosen_lengths.detach().to(dtype), inputs.rejected_lengths.detach().to(dtype)


def _smoothed_sigmoid_loss(z: Tensor, label_smoothing: float) -> Tensor:
    """``-(1 - eps) logsigmoid(z) - eps logsigmoid(-z)``: the Bradley-Terry negative log-likelihood of a
    preference whose label is flipped with probability ``eps`` (exactly ``-logsigmoid(z)`` at 0)."""
    return -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def _finish(inputs: PreferenceLossInputs, loss: Tensor, reward_w: Tensor, reward_l: Tensor) -> PreferenceLossOutput:
    reward_w, reward_l = reward_w.detach(), reward_l.detach()
    metrics = {
        "rewards/chosen": reward_w.mean(),
        "rewards/rejected": reward_l.mean(),
        "rewards/accuracy": (reward_w > reward_l).to(reward_w.dtype).mean(),
        "rewards/margin": (reward_w - reward_l).mean(),
        "logps/chosen": inputs.chosen_logps.detach().to(reward_w.dtype).mean(),
        "logps/rejected": inputs.rejected_logps.detach().to(reward_w.dtype).mean(),
    }
    return PreferenceLossOutput(loss=loss, metrics=metrics)


# ------------------------------------------------------------------------------------------------ losses

@_preference_loss("dpo", needs_reference=True)
def dpo(inputs: PreferenceLossInputs, config: PreferenceLossConfig) -> PreferenceLossOutput:
    """DPO (Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward
    Model"), with the conservative label smoothing of cDPO (Mitchell 2023, "A note on DPO with noisy
    preferences & relationship to IPO"):

    ``h = rho_w - rho_l`` (summed log-ratios, as in the paper), ``z = beta h``,
    ``loss = -(1 - eps) logsigmoid(z) - eps logsigmoid(-z)`` with ``eps = label_smoothing``
    (``eps = 0``: plain DPO, ``-logsigmoid(beta h)``).

    Reward: the paper's implicit reward ``r = beta * rho = beta (logp - ref)`` (summed over tokens).
    """
    logp_w, logp_l, dtype = _policy(inputs)
    ref_w, ref_l = _reference(inputs, "dpo", dtype)
    reward_w, reward_l = config.beta * (logp_w - ref_w), config.beta * (logp_l - ref_l)
    loss = _smoothed_sigmoid_loss(reward_w - reward_l, config.label_smoothing)
    return _finish(inputs, loss, reward_w, reward_l)


@_preference_loss("ipo", needs_reference=True, label_smoothing=False)
def ipo(inputs: PreferenceLossInputs, config: PreferenceLossConfig) -> PreferenceLossOutput:
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", Eq. 17, with ``tau = beta``):

    ``h = rho_w / |y_w| - rho_l / |y_l|``, ``loss = (h - 1 / (2 beta))^2``.

    The log-ratios are averaged over response tokens, not summed. The paper writes h on whole
    sequences, but the loss regresses h onto the fixed target ``1 / (2 beta)``: with sums that target
    means a per-token shift that shrinks with the response length, and the squared loss grows with the
    square of the length. TRL (1.16, ``DPOTrainer._compute_loss``, ``loss_type="ipo"``) averages for
    this reason and states that the IPO authors confirmed their reported results use the averaged form;
    this loss is the same so that a ``beta`` carries over. ``label_smoothing`` must be 0 (IPO has no
    label-flip term).

    Reward: the average log-ratio ``r = rho / |y|`` (not scaled by beta), so that ``rewards/margin`` is
    the h the loss pulls to ``1 / (2 beta)``.
    """
    if config.label_smoothing != 0.0:
        raise ValueError(f"preference loss 'ipo' has no label smoothing; set label_smoothing=0 "
                         f"(got {config.label_smoothing})")
    logp_w, logp_l, dtype = _policy(inputs)
    ref_w, ref_l = _reference(inputs, "ipo", dtype)
    len_w, len_l = _lengths(inputs, dtype)
    reward_w, reward_l = (logp_w - ref_w) / len_w, (logp_l - ref_l) / len_l
    loss = (reward_w - reward_l - 1.0 / (2.0 * config.beta)) ** 2
    return _finish(inputs, loss, reward_w, reward_l)


@_preference_loss("simpo", needs_reference=False)
def simpo(inputs: PreferenceLossInputs, config: PreferenceLossConfig) -> PreferenceLossOutput:
    """SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward",
    Eq. 6), reference-free and length-normalised, with the same optional label smoothing as DPO:

    ``z = simpo_beta / |y_w| * logp_w - simpo_beta / |y_l| * logp_l - simpo_gamma``,
    ``loss = -(1 - eps) logsigmoid(z) - eps logsigmoid(-z)``.

    ``simpo_gamma`` is the paper's gamma: the margin in reward units (the SimPO repository's
    ``gamma_beta_ratio`` is ``simpo_gamma / simpo_beta``). The reference inputs are not read (they may
    be None). ``beta`` is not used: SimPO has its own ``simpo_beta``.

    Reward: ``r = simpo_beta * logp / |y|`` (the paper's length-normalised reward).
    """
    logp_w, logp_l, dtype = _policy(inputs)
    len_w, len_l = _lengths(inputs, dtype)
    reward_w, reward_l = config.simpo_beta * logp_w / len_w, config.simpo_beta * logp_l / len_l
    loss = _smoothed_sigmoid_loss(reward_w - reward_l - config.simpo_gamma, config.label_smoothing)
    return _finish(inputs, loss, reward_w, reward_l)


@_preference_loss("kto", needs_reference=True, paired=False, label_smoothing=False)
def kto(inputs: UnpairedLossInputs, config: PreferenceLossConfig) -> PreferenceLossOutput:
    """KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", Eq. 7-8) on
    unpaired rows, as TRL 1.16's ``KTOTrainer`` (``loss_type="kto"``) computes it:

    ``rho = logp - ref`` (summed log-ratio), ``z0 = kl_baseline``;
    desirable row: ``loss = desirable_weight * (1 - sigmoid(beta (rho - z0)))``;
    undesirable row: ``loss = undesirable_weight * (1 - sigmoid(beta (z0 - rho)))``.

    ``z0`` is a constant (no gradient flows through it), estimated by the trainer from mismatched
    prompt/completion rows as the reference implementation does. ``label_smoothing`` must be 0.

    Reward: ``r = beta * rho``; ``rewards/chosen`` and ``logps/chosen`` are means over the desirable rows,
    ``rewards/rejected`` and ``logps/rejected`` over the undesirable ones (0 where there is none; their
    ``counts`` say so).
    """
    if config.label_smoothing != 0.0:
        raise ValueError(f"preference loss 'kto' has no label smoothing; set label_smoothing=0 "
                         f"(got {config.label_smoothing})")
    if inputs.ref_logps is None or inputs.kl_baseline is None:
        missing = "ref_logps" if inputs.ref_logps is None else "kl_baseline"
        raise ValueError(f"preference loss 'kto' needs UnpairedLossInputs.{missing}, which is None")
    dtype = compute_dtype(inputs.logps, inputs.ref_logps, inputs.kl_baseline)
    logp = inputs.logps.to(dtype)
    rho = logp - inputs.ref_logps.detach().to(dtype)
    z0 = inputs.kl_baseline.detach().to(dtype).reshape(())
    good = inputs.desirable
    loss = torch.where(good, config.desirable_weight * (1.0 - torch.sigmoid(config.beta * (rho - z0))),
                       config.undesirable_weight * (1.0 - torch.sigmoid(config.beta * (z0 - rho))))
    reward, logp = config.beta * rho.detach(), logp.detach()
    n_good, n_bad = good.sum().to(dtype), (~good).sum().to(dtype)
    zero = reward.new_zeros(())

    def mean_over(values: Tensor, rows: Tensor, count: Tensor) -> Tensor:
        return torch.where(rows, values, zero).sum() / count.clamp(min=1.0)

    metrics = {"rewards/chosen": mean_over(reward, good, n_good), "rewards/rejected": mean_over(reward, ~good, n_bad),
               "logps/chosen": mean_over(logp, good, n_good), "logps/rejected": mean_over(logp, ~good, n_bad)}
    counts = {"rewards/chosen": n_good, "rewards/rejected": n_bad, "logps/chosen": n_good, "logps/rejected": n_bad}
    return PreferenceLossOutput(loss=loss, metrics=metrics, counts=counts)


# --------------------------------------------------------------------------------------- reward model

def bradley_terry_loss(chosen_scores: Tensor, rejected_scores: Tensor,
                       margin: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Reward-model loss under the Bradley-Terry model (Bradley & Terry 1952; as in Ouyang et al. 2022,
    "Training language models to follow instructions with human feedback"), per pair [P]:

    ``loss = -logsigmoid(s_w - s_l - m)``, ``s`` the scalar scores [P] (with grad) and ``m`` an optional
    per-pair margin [P] (a constant, e.g. the preference strength as in Llama 2; 0 when None).

    Metrics (detached means over the pairs): ``rm/accuracy`` (fraction with ``s_w > s_l``, ties wrong,
    the margin not applied), ``rm/chosen_score``, ``rm/rejected_score``, ``rm/margin`` (mean score gap
    ``s_w - s_l``, not the input margin).
    """
    where = "bradley_terry_loss"
    if not isinstance(chosen_scores, Tensor) or chosen_scores.dim() != 1 or chosen_scores.shape[0] == 0:
        raise ValueError(f"{where}: chosen_scores must be a non-empty 1-D [P] tensor")
    shape = tuple(chosen_scores.shape)
    check_shape(where, "rejected_scores", rejected_scores, shape)
    check_shape(where, "margin", margin, shape)
    dtype = compute_dtype(chosen_scores, rejected_scores, margin)
    s_w, s_l = chosen_scores.to(dtype), rejected_scores.to(dtype)
    gap = s_w - s_l
    loss = -F.logsigmoid(gap if margin is None else gap - margin.detach().to(dtype))
    gap = gap.detach()
    metrics = {
        "rm/accuracy": (gap > 0).to(dtype).mean(),
        "rm/chosen_score": s_w.detach().mean(),
        "rm/rejected_score": s_l.detach().mean(),
        "rm/margin": gap.mean(),
    }
    return loss, metrics
