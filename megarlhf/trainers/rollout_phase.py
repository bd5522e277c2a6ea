"""Steps 2-5 of an RL step on this rank: wake the engine, sync weights, generate, put the trainer back.

Two placements, one interface (``generate(prompts, sampling, seed) -> (RolloutBatch, metrics)``),
chosen by :func:`build_rollout_phase` from ``rollout.placement``:

:class:`RolloutPhase` (colocate) owns this rank's vLLM engine, the verified Megatron -> vLLM weight
sync and the colocate scheduler. The ranks that hold the same data-parallel rank (the TP x PP x CP ranks of one
model replica) see the same prompts; rather than generating the same samples several times, each of
them generates a contiguous share and the replica all-gathers the results, so every rank of the replica
ends with the whole rollout in prompt order.

Seeds: prompt ``i`` of a :meth:`RolloutPhase.generate` call samples with seeds ``seed + i * n + j``
wherever it is generated, so with :func:`sample_seed` the samples depend only on the run seed, the step
and each prompt's position in the global batch: the same for any parallel layout and after a resume.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megarlhf.config.schema import RunConfig
from megarlhf.rollout.colocate import ColocateScheduler, OffloadedModel
from megarlhf.rollout.disaggregated import DisaggregatedRollout
from megarlhf.rollout.engine import EngineConfig, RolloutBatch, RolloutEngine, SamplingConfig
from megarlhf.rollout.weight_sync import WeightSync, WeightSyncConfig
from megarlhf.training import TrainModel

_SEED_STRIDE_PER_STEP = 1_000_003  # a prime larger than any global batch x samples per prompt


def sample_seed(run_seed: int, step: int, global_offset: int, n: int) -> int:
    """The seed of the first sample of the prompt at ``global_offset`` of step ``step``'s global batch."""
    return run_seed + step * _SEED_STRIDE_PER_STEP + global_offset * n


def _replica_group() -> tuple[dist.ProcessGroup | None, int, int]:
    """The group of ranks sharing this rank's data-parallel rank, this rank's index in it, its size."""
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    dp_ranks = [None] * world
    dist.all_gather_object(dp_ranks, ps.get_data_parallel_rank())
    mine = None
    for dp_rank in sorted(set(dp_ranks)):  # every rank creates every group, in the same order
        members = [r for r in range(world) if dp_ranks[r] == dp_rank]
        group = dist.new_group(members) if len(members) > 1 else None
        if dp_rank == dp_ranks[dist.get_rank()]:
            mine = (group, members.index(dist.get_rank()), len(members))
    return mine


def engine_config(config: RunConfig, in_process: bool = True) -> EngineConfig:
    rollout = config.rollout
    return EngineConfig(
        tensor_parallel_size=rollout.tensor_parallel_size, dtype=config.model.dtype, seed=config.seed,
        enforce_eager=rollout.enforce_eager, max_model_len=config.data.max_prompt_length + rollout.max_new_tokens,
        kv_cache_bytes=rollout.kv_cache_mb * 2**20, num_threads=torch.get_num_threads(), in_process=in_process,
        # the trainer scores responses at the sampling temperature (training.update.sampling_temperature),
        # so the engine must report log-probs after temperature scaling as well
        logprobs_mode="raw_logprobs" if rollout.temperature in (0.0, 1.0) else "processed_logprobs")


def sync_config(config: RunConfig) -> WeightSyncConfig:
    return WeightSyncConfig(bucket_mb=config.rollout.weight_sync_bucket_mb)


class RolloutPhase:
    """The engine side of the colocated loop for one rank."""

    def __init__(self, config: RunConfig, actor: TrainModel, others: list[TrainModel]):
        self.engine = RolloutEngine(config.model.path, engine_config(config))
        self.sync = WeightSync(self.engine, actor.provider, sync_config(config))
        self.scheduler = ColocateScheduler(self.engine, self.sync, OffloadedModel.of(actor),
                                           [OffloadedModel.of(m) for m in others])
        self.group, self.member, self.members = _replica_group()

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 seed: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Generates for this replica's ``prompts`` (prompt ``i`` with seeds ``seed + i * n + j``).

        Runs the whole colocated round trip: offload + verified sync, generation, onload.
        """
        share = torch.arange(len(prompts)).tensor_split(self.members)[self.member].tolist()
        first = share[0] if share else 0
        local_sampling = dataclasses.replace(sampling, seed=seed + first * sampling.n)
        metrics = self.scheduler.enter_rollout()
        try:
            local = (self.engine.generate([prompts[i] for i in share], local_sampling)
                     if share else RolloutBatch())
        finally:
            metrics.update(self.scheduler.exit_rollout())
        local.prompt_index = [share[i] for i in local.prompt_index]
        return self._gather(local), metrics

    def _gather(self, local: RolloutBatch) -> RolloutBatch:
        if self.group is None:
            return local
        parts = [None] * self.members
        dist.all_gather_object(parts, local, group=self.group)
        merged = RolloutBatch()
        for part in parts:
            for field in dataclasses.fields(RolloutBatch):
                getattr(merged, field.name).extend(getattr(part, field.name))
        return merged

    def close(self) -> None:
        """Nothing to release: the engine lives as long as the process."""


class DisaggregatedPhase:
    """The trainer ranks' side of the disaggregated placement: weights are broadcast to the engine ranks
    (verified) and the prompts travel there; nothing is offloaded."""

    def __init__(self, config: RunConfig, actor: TrainModel):
        self.actor = actor
        self.rollout = DisaggregatedRollout(config.rollout.placement, config.model.path, actor.provider,
                                            engine_config(config, in_process=False), sync_config(config))

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 seed: int) -> tuple[RolloutBatch, dict[str, float]]:
        metrics = self.rollout.sync(self.actor.model)
        return self.rollout.generate(prompts, dataclasses.replace(sampling, seed=seed)), metrics

    def close(self) -> None:
        self.rollout.stop_engines()


def serve_engine_rank(config: RunConfig) -> None:
    """An engine rank of the disaggregated placement: serves the trainers until they stop it."""
    DisaggregatedRollout(config.rollout.placement, config.model.path, None, engine_config(config, in_process=False),
                         sync_config(config)).serve()


def build_rollout_phase(config: RunConfig, actor: TrainModel, others: list[TrainModel]):
    """The rollout side for this trainer rank, as ``rollout.placement`` says."""
    if config.rollout.placement.mode == "disaggregated":
        return DisaggregatedPhase(config, actor)
    return RolloutPhase(config, actor, others)
