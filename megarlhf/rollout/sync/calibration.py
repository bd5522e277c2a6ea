"""The verification gates' calibration at start-up (:mod:`megarlhf.rollout.sync.gates`), for both placements.

Before the first sync the engine holds the checkpoint at ``model.path`` as its own loader read it, and
the actor the same checkpoint through megarlhf's converter. Calibration then:

1. **compares the weights bit for bit** (``rollout.weight_sync.check_checkpoint``): the engine reports the
   fingerprints of its own load of the checkpoint (``checkpoint_report``: taken while its first load was
   processed, or by reloading the checkpoint from disk; on CPU vLLM packs linear weights away after
   loading, so they can only be fingerprinted while a load processes them); the
   trainer fingerprints its tensors as a sync would send them (:class:`ExpectedFingerprints`). Any
   difference is a conversion error and stops the run here, before it could raise the floors below (a
   tensor off by 100 bf16 ulps moves the mean gap less than a 30-layer model's rounding noise does).
   Skipped when the engine computes in a finer dtype than the trainer holds (``model.dtype=bfloat16``,
   ``rollout.dtype=float32``): the two sides then hold different roundings of the checkpoint by design.
2. measures the **probe floor**: the weight-sync probe's gap (random tokens, teacher-forced);
3. measures the **natural floor** (``rollout.weight_sync.calibration_prompts`` of the run's prompts): the
   engine samples them as the rollout does (its temperature, samples per prompt and stop tokens; fixed
   seeds; at most ``probe_max_length`` new tokens) and the trainer scores the samples: the step-0 gate's
   own measure, on the same kind of tokens. Each data-parallel replica samples and scores its share of
   the prompts (:func:`replica_share`); the floor is the worst replica's.

The floors set the run's tolerances (:func:`megarlhf.rollout.sync.gates.run_tolerances`); a floor mean above the
dtype's cap stops the run. Everything here is collective over the trainer ranks, which raise together.

A run leaves step 3 to its first step (``natural_at_step0``) when step 1 proved that the engine holds what
a sync would send (no LoRA adapters: :meth:`~megarlhf.rollout.sync.held.HeldWeights.checkpoint_verified`):
the syncs before step 0's rollout are then skipped (nothing changed), so step 0 is sampled from the
engine's own load of ``model.path``, exactly as the natural samples are, with the run's own settings and
more prompts. The step-0 gate then takes its gap as the natural floor (:func:`step0_problems`): capped as
above, it sets the run's tolerances. That saves sampling and scoring prompts twice at start-up (14.5 s of
38 on the SmolLM2 recipe on CPU). Should anything be sent before step 0 after all, the step-0 gate uses
the probe's floor, as a run without calibration prompts does.
"""
from __future__ import annotations

import dataclasses

import torch

from megarlhf.core import startup
from megarlhf.core.dtypes import coarser_dtype
from megarlhf.core.seeds import CALIBRATION_SEED
from megarlhf.rollout.engines.sampling import RolloutBatch, SamplingConfig, rollout_sampling
from megarlhf.rollout.sync.gates import Tolerances, calibration_problems, run_tolerances
from megarlhf.rollout.sync.weights import (ExpectedFingerprints, WeightSync, compare_fingerprints, probe_floor,
                                          trainer_probe_logprobs, verdict_error)
from model_providers.hf_checkpoint import iter_hf_weights
from parallel.lora import adapters_disabled

CHECKPOINT_CHECK = "calibration: the engine's own load of model.path vs the trainer's conversion, bit for bit"
FLOORS_CHECK = "calibration before the first sync"


def checks_checkpoint(config) -> bool:
    """Whether calibration compares the engine's own load of ``model.path`` with the trainer's conversion:
    asked for, and the engine rounds no finer than the trainer (module docstring)."""
    engine = config.rollout.engine_dtype(config.model.dtype)
    return config.rollout.weight_sync.check_checkpoint and coarser_dtype(config.model.dtype, engine) == engine


def trainer_fingerprints(actor, placement: dict[str, tuple[str, int]] | None, engine_dtype: torch.dtype
                         ) -> dict[str, tuple[int, int]]:
    """The fingerprints the engine's parameters must have if it holds the actor's weights. Collective over
    the trainer ranks (the gathers of ``iter_hf_weights``): a rank without ``placement`` only takes part
    in them and returns {}."""
    expected = ExpectedFingerprints(placement, engine_dtype) if placement is not None else None
    with adapters_disabled(actor.model):  # model.path holds the base: LoRA adapters are not part of it
        for name, tensor in iter_hf_weights(actor.model, actor.provider, copies=False):
            if expected is not None:
                expected.add(name, tensor)
    return expected.result() if expected is not None else {}


def checkpoint_problems(expected: dict[str, tuple[int, int]], report: dict) -> list[str]:
    """Where the trainer's conversion of the checkpoint differs from the engine's own load of it
    (``report``: the engine's ``checkpoint_report``)."""
    return [f"{p} (the trainer converted model.path, the engine loaded it itself: a conversion error)"
            for p in compare_fingerprints(expected, report)]


def natural_sampling(config, stop_token_ids: tuple[int, ...]) -> SamplingConfig:
    """How calibration samples the run's prompts: as the rollout does, with fixed seeds, at most
    ``probe_max_length`` new tokens (module docstring)."""
    sampling = rollout_sampling(config.rollout, stop_token_ids)
    cap = config.rollout.weight_sync.probe_max_length or sampling.max_new_tokens
    return dataclasses.replace(sampling, seed=CALIBRATION_SEED, max_new_tokens=min(sampling.max_new_tokens, cap))


def replica_share(prompts, runtime, engine_tp: int = 1) -> tuple[list, list[int]]:
    """This data-parallel replica's share of the calibration prompts (every DP-th one from its rank) and
    their indices: the replicas sample and score disjoint shares, together the samples one replica alone
    would draw (each prompt keeps its seed), at 1/DP of the work each. An engine over several ranks
    (``engine_tp`` > 1, colocated) takes the same prompts on each of them: then every replica has them all."""
    indices = list(range(len(prompts)))
    if engine_tp == 1:
        indices = indices[runtime.dp.rank::runtime.dp.size]
    return [prompts[i] for i in indices], indices


def natural_gap(actor, batch: RolloutBatch, config) -> tuple[float, float]:
    """(max, mean) |trainer - engine| log-prob gap over the sampled tokens of ``batch`` (the step-0 gate's
    measure); (0, 0) without any. Collective over the actor's model-parallel group (its ranks pass the
    same batch)."""
    from megarlhf.learner import ExperienceBatch, compute_logprobs

    if not any(batch.response_ids):
        return 0.0, 0.0
    # under routing replay (r3) the engine's routing comes along and is replayed, as at step 0
    experience = ExperienceBatch.from_sequences(batch.prompt_ids, batch.response_ids, device=actor.runtime.device,
                                                rollout_logprobs=batch.logprobs,
                                                routed_experts=batch.routed_experts or None)
    logprobs = compute_logprobs(actor, experience, config)
    gap = (logprobs - experience.rollout_logprobs).abs()[experience.response_mask]
    worst, mean = torch.stack([gap.max(), gap.mean()]).tolist()  # host: one read, at start-up
    return worst, mean


def worst_of(gaps: list[tuple[float, float] | None]) -> tuple[float, float] | None:
    """The largest max and the largest mean over ranks or engines (None where nothing was measured)."""
    measured = [g for g in gaps if g is not None]
    if not measured:
        return None
    return max(g[0] for g in measured), max(g[1] for g in measured)


def floor_problems(config, floor: tuple[float, float] | None, natural: tuple[float, float] | None,
                   is_moe: bool) -> list[str]:
    problems = calibration_problems(config, floor[1], "the probe", is_moe) if floor is not None else []
    if natural is not None:  # replayed under r3 (natural_gap)
        problems += calibration_problems(config, natural[1], "the natural samples", is_moe,
                                         replayed=config.algorithm.routing_replay == "r3")
    return problems


def calibration_metrics(floor: tuple[float, float] | None, natural: tuple[float, float] | None,
                        checkpoint_checked: bool, tolerances: Tolerances) -> dict[str, float]:
    metrics = {"gates/calibration_checkpoint_bitwise": float(checkpoint_checked)}
    for name, gaps in (("probe", floor), ("natural", natural)):
        if gaps is not None:
            metrics.update({f"gates/calibration_{name}_max": gaps[0], f"gates/calibration_{name}_mean": gaps[1]})
    return {**metrics, **{f"gates/{name}": value for name, value in vars(tolerances).items()}}


def checkpoint_verified(sync) -> None:
    """After a passed bitwise check: the engines hold what a sync of the actor would send, unless LoRA
    adapters are part of what it sends (the check compares the base)."""
    if sync.config.model.lora is None:
        sync.held.checkpoint_verified()


def decide_natural_floor(sync, prompts, natural_at_step0: bool) -> bool:
    """Decides whether step 0 measures the natural floor (module docstring) instead of calibration sampling
    ``prompts`` (asked for, and the engines were proven to hold what a sync would send), records the
    decision as ``sync.natural_deferred`` and returns it."""
    sync.natural_deferred = bool(prompts) and natural_at_step0 and sync.held.own_load
    return sync.natural_deferred


def step0_problems(sync, calibration: dict[str, float], max_gap: float, mean_gap: float) -> list[str]:
    """The step-0 gate's verdict on step 0's (max, mean) gap over the global batch (the same on every
    trainer rank) for ``sync`` (a WeightSync or the disaggregated RemoteEngines). When calibration left the
    natural floor to step 0 and the engines still hold their own load of ``model.path`` (nothing was sent),
    the gap is that floor: capped as calibration caps it (raising as calibration would), it sets the run's
    tolerances and joins the calibration's metrics (``calibration``, updated). Otherwise the gap is judged
    by the tolerances."""
    if not (sync.natural_deferred and sync.held.own_load):
        return sync.tolerances.step0_problems(max_gap, mean_gap)
    natural = (max_gap, mean_gap)
    problems = floor_problems(sync.config, None, natural, sync.actor.provider.is_moe)
    if problems:
        raise verdict_error(problems, FLOORS_CHECK)
    sync.natural_deferred = False
    sync.tolerances = run_tolerances(sync.config, sync.floor, natural)
    calibration.update(calibration_metrics(sync.floor, natural, True, sync.tolerances))
    return []


def calibrate_colocated(sync: WeightSync, prompts: list[list[int]], stop_token_ids: tuple[int, ...],
                        natural_at_step0: bool = False) -> dict[str, float]:
    """Calibrates ``sync``'s gates (sets ``sync.tolerances``) against its colocated engine, which must still
    hold the checkpoint it loaded; ``prompts``: the run's first prompts (token ids), sampled for the natural
    floor (unless ``natural_at_step0`` leaves it to step 0: module docstring). Returns the calibration
    metrics. Collective over the trainer ranks. The actor computes with its LoRA adapters off (they may
    start from ``model.lora.adapter_path`` or a checkpoint)."""
    with adapters_disabled(sync.actor.model):  # the engine holds model.path: the base, whatever adapters start
        return _calibrate_colocated(sync, prompts, stop_token_ids, natural_at_step0)


def _calibrate_colocated(sync: WeightSync, prompts: list[list[int]], stop_token_ids: tuple[int, ...],
                         natural_at_step0: bool) -> dict[str, float]:
    config, runtime = sync.config, sync.runtime
    checked = checks_checkpoint(config)
    if checked:
        expected = trainer_fingerprints(sync.actor, sync.placement, sync.engine_dtype)
        sync.agree(checkpoint_problems(expected, sync.engine.checkpoint_report()), CHECKPOINT_CHECK)
        checkpoint_verified(sync)
        startup.mark("calibration_checkpoint_check")
    floor = natural = None
    if sync.probe:
        trainer = trainer_probe_logprobs(sync.actor, sync.probe, config)
        floor = probe_floor(trainer, sync.engine.prompt_logprobs(sync.probe))
        startup.mark("calibration_probe")
    mine, indices = replica_share(prompts, runtime, config.rollout.tensor_parallel_size)
    if decide_natural_floor(sync, prompts, natural_at_step0):
        mine = []
    if mine:
        batch = sync.engine.generate(mine, natural_sampling(config, stop_token_ids).for_prompts(indices))
        startup.mark("calibration_natural_samples")
        batch = runtime.all_gather_objects(batch, over="replica")[0]  # the replica scores one batch together
        natural = natural_gap(sync.actor, batch, config)
        startup.mark("calibration_natural_scoring")
    floor = worst_of(runtime.all_gather_objects(floor, over="trainers"))
    natural = worst_of(runtime.all_gather_objects(natural, over="trainers"))
    sync.agree(floor_problems(config, floor, natural, sync.actor.provider.is_moe), FLOORS_CHECK)
    sync.floor, sync.tolerances = floor, run_tolerances(config, floor, natural)
    return calibration_metrics(floor, natural, checked, sync.tolerances)
