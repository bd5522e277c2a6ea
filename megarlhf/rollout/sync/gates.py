"""The verification gates of an RL run and the one rule that sets their tolerances.

Three checks stop a run whose rollout engine does not run the model being trained:

* **weight-sync probe** (every sync, :mod:`megarlhf.rollout.sync.weights`): engine vs trainer log-probs
  of fixed random sequences, teacher-forced;
* **step-0 log-prob gap** (:func:`megarlhf.loops.experience.score`): the trainer's log-probs of the
  first rollout vs the engine's own, before any update;
* **step-0 ppo_kl** (the RL driver): with one optimizer update per step the first update's ratio is
  exactly 1, so ``actor/ppo_kl`` must be 0.

The two log-prob gates bound both the largest and the mean ``|trainer - engine|`` over the tokens
compared: the maximum catches one position gone wrong, the mean a systematic error (a mangled weight
tensor shifts every token) that a loose maximum would let through.

The rule. Trainer and engine round to the coarser of ``model.dtype`` and ``rollout.dtype``; that dtype
picks a row of :data:`FLOORS`. In float32 the floors are the tolerances. In bfloat16 the gap of a correct
engine grows with the model (depth, logit scale), so a fixed number cannot both pass a real model and
catch a broken sync: the gates are *calibrated* once per run, before the first sync, while the engine
holds the checkpoint it loaded itself (its own loader) and the trainer the same checkpoint
(:mod:`megarlhf.rollout.sync.calibration`). First the two sides' weights are compared bit for bit (a
conversion error of one ulp stops the run there, so no weight fault can raise the floors below); then
their log-prob gaps are the pair's rounding noise, measured twice:

* the **probe floor**: the weight-sync probe (random tokens, teacher-forced) -> the probe's tolerances;
* the **natural floor**: a few of the run's prompts sampled as the rollout samples them, the engine's
  log-probs of its samples vs the trainer's: the step-0 gate's own measure -> the step-0 tolerances
  (the probe's floor when no natural samples were drawn). When the bitwise check passed and the first
  sync has nothing new to send (a fresh run without LoRA adapters), step 0 is sampled from the engine's
  own load too, so its samples are natural samples: the run measures the natural floor on them, capped
  the same way, instead of sampling prompts of its own at start-up
  (:func:`megarlhf.rollout.sync.calibration.step0_problems`).

    max tolerance = max(FLOORS.max, 5 x floor max gap),   mean tolerance = max(FLOORS.mean, 3 x floor mean gap)

A floor mean above :data:`CALIBRATION_CAPS` stops the run at start-up: with bitwise-equal weights the
engine and the trainer compute different functions (an architecture feature one side ignores). Any
tolerance set in the ``gates`` section of a recipe is used as given. Calibrations of real models:
docs/MEASUREMENTS.md.

Mixture-of-experts models. A token whose router scores are near-tied can go to other experts in the
trainer than in the engine (their roundings differ), and its log-prob then moves by far more than rounding
(hundredths, in fp32). Routing replay r3 (``algorithm.routing_replay``) gives the trainer the engine's
routing for the step-0 gate and the natural floor, which then sit at the dtype's floor; the probe's random
tokens were routed by no rollout, so the probe is never replayed and its floor includes such flips: on a
model with near-tied routers its calibrated fp32 tolerance rises from 1e-4 to what the flips measure (about
0.09 on a tiny near-tied Qwen3-MoE). The weight sync still compares every parameter bit for bit
(fingerprints), which is what catches a broken sync there. Without replay a gap from flips fails the
step-0 gate, and its message says so (:func:`routing_flips`) instead of blaming the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

from megarlhf.config.train import GateConfig
from megarlhf.core.dtypes import coarser_dtype

MEAN_FACTOR, MAX_FACTOR = 3.0, 5.0


class Step0Gate(Protocol):
    """What judges step 0's log-prob gap: :class:`Tolerances`, or a run's rollout phase (whose calibration
    may have left the natural floor to step 0)."""

    def step0_problems(self, max_gap: float, mean_gap: float) -> list[str]:
        ...


@dataclass(frozen=True)
class Tolerances:
    """Resolved tolerances of the three gates (see the module docstring)."""

    probe_max: float
    probe_mean: float
    step0_max: float
    step0_mean: float
    step0_ppo_kl: float

    def step0_problems(self, max_gap: float, mean_gap: float) -> list[str]:
        """Why step 0's (max, mean) gap over the response tokens fails the step-0 gate (empty: it passes)."""
        return gap_problems("step-0 gate", max_gap, mean_gap, self.step0_max, self.step0_mean,
                            ("step0_max", "step0_mean"))


FLOORS: dict[str, Tolerances] = {
    "float32": Tolerances(probe_max=1e-4, probe_mean=1e-5, step0_max=1e-3, step0_mean=1e-4, step0_ppo_kl=1e-6),
    "bfloat16": Tolerances(probe_max=0.25, probe_mean=0.03, step0_max=0.5, step0_mean=0.02, step0_ppo_kl=1e-4),
}
# The largest mean gap between a trainer and an engine that both loaded the checkpoint themselves
CALIBRATION_CAPS = {"float32": 1e-3, "bfloat16": 0.5}


def resolve_tolerances(model_dtype: str, rollout_dtype: str, overrides: GateConfig,
                       floor: tuple[float, float] | None = None,
                       natural: tuple[float, float] | None = None) -> Tolerances:
    """The rule's tolerances for the two dtypes; ``floor`` = (max, mean) gap of the calibration probe and
    ``natural`` = (max, mean) gap of the calibration's natural samples (None: not measured; the probe's
    floor then sets the step-0 tolerances, and without it the dtype's floors apply); values set in
    ``overrides`` win."""
    base = FLOORS[coarser_dtype(model_dtype, rollout_dtype)]
    values = {f.name: getattr(base, f.name) for f in fields(Tolerances)}
    for gate, gaps in (("probe", floor), ("step0", natural if natural is not None else floor)):
        if gaps is not None:
            values[f"{gate}_max"] = max(values[f"{gate}_max"], MAX_FACTOR * gaps[0])
            values[f"{gate}_mean"] = max(values[f"{gate}_mean"], MEAN_FACTOR * gaps[1])
    values.update({f.name: getattr(overrides, f.name) for f in fields(GateConfig)
                   if getattr(overrides, f.name) is not None})
    return Tolerances(**values)


def run_tolerances(config, floor: tuple[float, float] | None = None,
                   natural: tuple[float, float] | None = None) -> Tolerances:
    """:func:`resolve_tolerances` for a ``RunConfig`` (trainer dtype, engine dtype, ``gates`` overrides)."""
    return resolve_tolerances(config.model.dtype, config.rollout.engine_dtype(config.model.dtype), config.gates,
                              floor, natural)


def routing_flips(config, is_moe: bool, replayed: bool) -> str | None:
    """Why a mixture-of-experts model gaps where its weights agree: a token whose router scores are
    near-tied goes to other experts in the trainer than in the engine (their roundings differ), which moves
    its log-prob far more than rounding does. ``replayed``: the measure replays the engine's routing (the
    step-0 gate and the natural samples under r3; never the probe, whose random tokens no rollout routed).
    None for a dense model or a replayed measure."""
    if not is_moe or replayed:
        return None
    flips = ("a token with near-tied router scores goes to other experts in the trainer than in the engine, "
             "which moves its log-prob far more than rounding does")
    if config.algorithm.routing_replay == "r3":
        return f"routing replay r3 does not reach the probe's random tokens (no rollout routed them): {flips}"
    return (f"this mixture-of-experts model is routed freely (algorithm.routing_replay="
            f"'{config.algorithm.routing_replay}'): {flips}; algorithm.routing_replay='r3' replays the engine's "
            f"routing")


def calibration_problems(config, floor_mean: float, what: str = "the probe", is_moe: bool = False,
                         replayed: bool = False) -> list[str]:
    """Why a calibration floor (``what`` measured it, replaying the engine's routing or not) is implausible:
    the engine and the trainer compute different functions of the checkpoint (or, for an MoE model, route
    some tokens apart: :func:`routing_flips`)."""
    dtype = coarser_dtype(config.model.dtype, config.rollout.engine_dtype(config.model.dtype))
    cap = CALIBRATION_CAPS[dtype]
    if floor_mean <= cap:
        return []
    cause = routing_flips(config, is_moe, replayed) or ("the engine does not run the model the trainer loaded (an "
                                                        "unsupported architecture feature or a conversion error)")
    return [f"calibration: with the checkpoint each side loaded itself, the mean |trainer - engine| log-prob "
            f"gap of {what} is {floor_mean:.3g} > {cap:g} ({dtype}): {cause}"]


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
