"""Every seed a run derives from ``seed``: one place, so that the strides can be read side by side.

A sample's seed is ``sample_seed(run_seed, step, global_offset, n)``: the run seed, plus the step times
:data:`STEP_STRIDE`, plus the prompt's position in the global batch times the samples per prompt, so the
samples depend on the run seed, the step and the prompt's global position only (not on the layout or
the engine that generates them). The other streams are offsets of the run seed:

- :data:`ROUND_STRIDE` per extra DAPO dynamic-sampling round of a step;
- :data:`EVAL_OFFSET` for evaluation samples (never a training sample's seed);
- :data:`TURN_STRIDE` per turn of a multi-turn episode (added to the episode's first seed);
- :data:`RESUME_RESEED_STRIDE` per step when a resume at another world size reseeds torch/numpy/random;
- :data:`CALIBRATION_SEED` and :data:`PROBE_SEED` are fixed: the gates' calibration samples and the
  weight-sync probe's random sequences are the same for every run and layout.

The streams are disjoint while a step's ``global_batch_size x n_samples`` stays below
:data:`STEP_STRIDE` (1,000,003) and, with multi-turn episodes, below ``8 x STEP_STRIDE - TURN_STRIDE``
(80,031): turn 1 of step ``s`` then starts after step ``s + 7`` and ends before step ``s + 8``.
"""
from __future__ import annotations

STEP_STRIDE = 1_000_003  # a prime larger than any global batch x samples per prompt
ROUND_STRIDE = 1 << 32  # DAPO's extra rounds of a step (below EVAL_OFFSET)
EVAL_OFFSET = 1 << 40  # evaluation samples never share seeds with training samples
TURN_STRIDE = 7_919_993  # a prime: turn t of an episode samples with its first seed + t * TURN_STRIDE
RESUME_RESEED_STRIDE = 7919  # a resume at another world size reseeds the host RNGs with seed + 7919 * step
CALIBRATION_SEED = 4321  # the gates' natural samples: the same calibration for any layout and rerun
PROBE_SEED = 1234  # the weight-sync probe's random sequences are the same at every sync


def sample_seed(run_seed: int, step: int, global_offset: int, n: int) -> int:
    """The seed of the first sample of the prompt at ``global_offset`` of step ``step``'s global batch."""
    return run_seed + step * STEP_STRIDE + global_offset * n
