"""Steps 2-5 of an RL step on this rank: wake the engine, sync weights, generate, put the trainer back.

Two placements, one interface (``generate(prompts, sampling, seed) -> (RolloutBatch, metrics)``),
chosen by :func:`build_rollout_phase` from ``rollout.placement``:

:class:`RolloutPhase` (colocate) owns this rank's engine (the ``rollout.backend`` registered in
:data:`~megarlhf.rollout.engines.ENGINES`), the verified Megatron -> engine weight sync and the colocate scheduler. The ranks of one
model replica (its TP x PP x CP ranks, ``runtime.replica``) see the same prompts; rather than generating
the same samples several times, each of them generates a contiguous share and the replica all-gathers
the results, so every rank of the replica ends with the whole rollout in prompt order.

Seeds: prompt ``i`` of a :meth:`RolloutPhase.generate` call samples with seeds ``seed + i * n + j``
wherever it is generated, so with :func:`megarlhf.core.seeds.sample_seed` the samples depend only on the run
seed, the step and each prompt's position in the global batch: the same for any parallel layout and after a
resume.

Every trainer rank calls ``generate`` together, with or without prompts of its own (the weight sync
inside is collective): a rank with nothing to generate still takes part.

Building a phase calibrates the verification gates (:mod:`megarlhf.rollout.sync.gates`) while the engines hold the
checkpoint they loaded and the actor the same one: build it before a resume loads other weights. Its
``tolerances`` are then the run's; ``calibration`` holds the calibration's metrics (completed by
:meth:`RolloutPhase.step0_problems`, the step-0 gate's verdict, when calibration left the natural floor to
step 0).
"""
from __future__ import annotations

import dataclasses

import torch

from megarlhf.config.schema import RunConfig
from megarlhf.core import startup
from megarlhf.core.errors import ConfigError
from megarlhf.data.prompts import PromptExample, uses_chat_template
from megarlhf.learner import TrainModel
from megarlhf.rollout.colocate import ColocateScheduler, OffloadedModel
from megarlhf.rollout.disaggregated.engine_side import RESTARTS_METRIC, EngineServer, Restarts
from megarlhf.rollout.disaggregated.protocol import Channel, merged_sampling
from megarlhf.rollout.disaggregated.trainer_side import RemoteEngines
from megarlhf.rollout.engines import EngineConfig, RolloutBatch, SamplingConfig, build_engine
from megarlhf.rollout.engines.routing import engine_routing
from megarlhf.rollout.multi_turn import MultiTurnRollout
from megarlhf.rollout.sync.adapters import AdapterSync, adapter_only, engine_lora
from megarlhf.rollout.sync.calibration import calibrate_colocated, step0_problems
from megarlhf.rollout.sync.weights import WeightSync
from parallel.runtime import Runtime


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What the gates' calibration samples for its natural floor (:mod:`megarlhf.rollout.sync.calibration`):
    the run's first prompts (token ids; none: the probe's floor sets the step-0 tolerances) and the
    rollout's stop tokens; ``natural_at_step0``: a run with a step-0 gate lets it measure the natural floor
    when it can (:mod:`megarlhf.rollout.sync.calibration`)."""

    prompts: tuple[tuple[int, ...], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    natural_at_step0: bool = False

    @classmethod
    def of_run(cls, config: RunConfig, prompts: list[PromptExample], stop_token_ids: tuple[int, ...],
               natural_at_step0: bool = False) -> "Calibration":
        first = prompts[:config.rollout.weight_sync.calibration_prompts]
        return cls(tuple(tuple(p.prompt_ids) for p in first), stop_token_ids, natural_at_step0)


def engine_config(config: RunConfig, in_process: bool = True) -> EngineConfig:
    _check_positions(config)
    return EngineConfig.from_rollout(config.rollout, model_dtype=config.model.dtype, seed=config.seed,
                                     max_prompt_length=config.data.max_prompt_length, in_process=in_process,
                                     **engine_lora(config), **engine_routing(config))


def _check_positions(config: RunConfig) -> None:
    """A prompt and its response must fit the model's positions (the engines hold that many)."""
    from model_providers import get_provider

    limit = getattr(get_provider(config.model.path).hf_config, "max_position_embeddings", None)
    longest = config.data.max_prompt_length + config.rollout.response_budget
    if limit is not None and longest > limit:
        raise ConfigError(f"data.max_prompt_length={config.data.max_prompt_length} plus the response budget "
                          f"{config.rollout.response_budget} (rollout.max_new_tokens, or max_response_tokens for "
                          f"multi-turn) is {longest} tokens, more than the {limit} positions of {config.model.path} "
                          f"(max_position_embeddings); lower them")


class RolloutPhase:
    """The engine side of the colocated loop for one rank."""

    def __init__(self, config: RunConfig, actor: TrainModel, others: list[TrainModel],
                 multi_turn: MultiTurnRollout | None = None, calibration: Calibration = Calibration()):
        self.runtime, self.multi_turn = actor.runtime, multi_turn
        # one vLLM engine over all ranks: each of them must add the same requests (every replica's prompts)
        self.engine_spans_ranks = config.rollout.tensor_parallel_size > 1
        self.engine = build_engine(config.model.path, engine_config(config), self.runtime.device)
        startup.mark("engine")
        self.sync = (AdapterSync if adapter_only(config) else WeightSync)(self.engine, actor, config)
        self.calibration = calibrate_colocated(self.sync, calibration.prompts, calibration.stop_token_ids,
                                               calibration.natural_at_step0)
        self.scheduler = ColocateScheduler(self.engine, self.sync, OffloadedModel.of(actor),
                                           [OffloadedModel.of(m) for m in others if not m.shares_actor])
        self.actor, self.engine_version = actor, actor.policy_version  # the engine holds model.path

    @property
    def tolerances(self):
        return self.sync.tolerances

    def step0_problems(self, max_gap: float, mean_gap: float) -> list[str]:
        """The step-0 gate's verdict (:func:`megarlhf.rollout.sync.calibration.step0_problems`)."""
        return step0_problems(self.sync, self.calibration, max_gap, mean_gap)

    def generate(self, prompts: list[PromptExample], sampling: SamplingConfig, seed: int,
                 sync_weights: bool = True) -> tuple[RolloutBatch, dict[str, float]]:
        """Generates for this replica's ``prompts`` (prompt ``i`` with seeds ``seed + i * n + j``), whole
        episodes when the phase has a multi-turn rollout.

        Runs the whole colocated round trip: offload + verified sync (unless ``sync_weights=False``: the
        actor has not changed since the last sync), generation, onload.
        """
        replica = self.runtime.replica
        share = torch.arange(len(prompts)).tensor_split(replica.size)[replica.rank].tolist()  # host: indices
        if self.engine_spans_ranks:  # single-turn only (config): the replica's ranks all take the whole batch
            share = list(range(len(prompts)))
        local_sampling = dataclasses.replace(sampling, seed=seed).for_prompts(share)
        metrics = self.scheduler.enter_rollout(sync_weights)
        if sync_weights:  # verified (or skipped: the engine held these very weights)
            self.engine_version = self.actor.policy_version
        tools = {}
        try:
            mine = [prompts[i] for i in share]
            if self.engine_spans_ranks:
                local = self._generate_together([p.prompt_ids for p in mine], local_sampling)
            elif self.multi_turn is None:
                local = self.engine.generate([p.prompt_ids for p in mine], local_sampling) if share else RolloutBatch()
            else:  # every rank runs its share's episodes on its own engine
                engine = self.engine.generate if share else (lambda prompts, sampling: RolloutBatch())
                local, tools = self.multi_turn.run(engine, mine, local_sampling)
        finally:
            metrics.update(self.scheduler.exit_rollout())
        local.prompt_index = [share[i] for i in local.prompt_index]
        local.stamp_versions(self.engine_version)
        if tools:  # this replica's totals on each of its ranks
            metrics.update(dict(zip(tools, self.runtime.all_reduce(list(tools.values()), over="replica"))))
        return (local if self.engine_spans_ranks else self._gather(local)), metrics

    def _generate_together(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        """Generates every replica's prompts (each with its replica's seeds) on the engine all ranks share, and
        returns this replica's samples (``prompt_index`` into ``prompt_ids``). Collective over the trainers."""
        everyone = self.runtime.all_gather_objects((self.runtime.dp.rank, prompt_ids, sampling), over="trainers")
        replicas, samplings = {}, {}
        for dp, ids, theirs in everyone:  # the ranks of one replica pass the same prompts
            replicas.setdefault(dp, ids)
            samplings.setdefault(dp, theirs)
        order = [(dp, i) for dp in sorted(replicas) for i in range(len(replicas[dp]))]
        batch = self.engine.generate([replicas[dp][i] for dp, i in order], merged_sampling(samplings, order))
        start = sum(len(replicas[dp]) for dp in replicas if dp < self.runtime.dp.rank)
        keep = [k for k, i in enumerate(batch.prompt_index) if start <= i < start + len(prompt_ids)]
        mine = RolloutBatch()
        for field in dataclasses.fields(RolloutBatch):
            values = getattr(batch, field.name)
            if len(values) == len(batch.prompt_index):  # per-sample fields (unused ones stay empty)
                getattr(mine, field.name).extend(values[k] for k in keep)
        mine.prompt_index = [i - start for i in mine.prompt_index]
        return mine

    def _gather(self, local: RolloutBatch) -> RolloutBatch:
        parts = self.runtime.all_gather_objects(local, over="replica")
        if len(parts) == 1:
            return local
        merged = RolloutBatch()
        for part in parts:
            for field in dataclasses.fields(RolloutBatch):
                getattr(merged, field.name).extend(getattr(part, field.name))
        return merged

    def close(self) -> None:
        """Stops the tool threads; the engine lives as long as the process."""
        if self.multi_turn is not None:
            self.multi_turn.close()


class DisaggregatedPhase:
    """The trainer ranks' side of the disaggregated placement: weights are broadcast to the engine ranks
    (verified) and the prompts travel there; nothing is offloaded.

    :meth:`launch` / :meth:`receive` split :meth:`generate` so that the engines generate while the trainers
    update (one-step off-policy training, :mod:`megarlhf.loops.pipeline`). A :meth:`generate` (an
    evaluation) while a batch is in flight first takes that batch and keeps it for :meth:`receive`."""

    def __init__(self, config: RunConfig, actor: TrainModel, calibration: Calibration = Calibration()):
        self.rollout = RemoteEngines(config, Channel.of_run(config, actor.runtime), actor,
                                     adapter_only=adapter_only(config))
        startup.mark("engine_channel")  # the engine ranks start their engines meanwhile
        self.calibration = self.rollout.calibrate(calibration.prompts, calibration.stop_token_ids,
                                                  calibration.natural_at_step0)
        startup.mark("calibration")
        self.runtime = actor.runtime
        self.episodes = config.rollout.env is not None  # the engine ranks run whole multi-turn episodes
        self.in_flight = None  # the InFlight request of the launched batch
        self.received = None  # (RolloutBatch, metrics) taken early

    @property
    def tolerances(self):
        return self.rollout.tolerances

    def step0_problems(self, max_gap: float, mean_gap: float) -> list[str]:
        """The step-0 gate's verdict (:func:`megarlhf.rollout.sync.calibration.step0_problems`)."""
        return step0_problems(self.rollout, self.calibration, max_gap, mean_gap)

    def generate(self, prompts: list[PromptExample], sampling: SamplingConfig, seed: int,
                 sync_weights: bool = True) -> tuple[RolloutBatch, dict[str, float]]:
        if self.in_flight is not None:
            self.received = self.receive()
        metrics = self.rollout.sync() if sync_weights else {}
        request = self.rollout.launch(self._requests(prompts), dataclasses.replace(sampling, seed=seed), self.episodes)
        batch, timing = self.rollout.receive(request)
        kept = ("tools/", RESTARTS_METRIC, "time/engine_restart_sync_s")
        return batch, {**metrics, **{k: v for k, v in timing.items() if k.startswith(kept)}}

    def _requests(self, prompts: list[PromptExample]) -> list:
        """What the engines are sent: token ids, or the examples whose episodes they run (multi-turn)."""
        return list(prompts) if self.episodes else [p.prompt_ids for p in prompts]

    def sync(self) -> dict[str, float]:
        """Pushes the trainers' weights to the engines (nothing may be in flight); the sync's metrics."""
        if self.in_flight is not None:
            raise RuntimeError("DisaggregatedPhase.sync: a batch is in flight; receive it first")
        return self.rollout.sync()

    def launch(self, prompts: list[PromptExample], sampling: SamplingConfig, seed: int,
               sync_weights: bool) -> dict[str, float]:
        """Syncs (unless ``sync_weights=False``) and starts generating ``prompts``; returns at once, with
        the sync's metrics."""
        if self.in_flight is not None or self.received is not None:
            raise RuntimeError("DisaggregatedPhase.launch: a batch is already in flight; receive it first")
        metrics = self.rollout.sync() if sync_weights else {}
        self.in_flight = self.rollout.launch(self._requests(prompts), dataclasses.replace(sampling, seed=seed),
                                             self.episodes)
        return metrics

    def receive(self) -> tuple[RolloutBatch, dict[str, float]]:
        """The launched batch (waiting for the engines if they are not done) and its timings."""
        if self.received is not None:
            taken, self.received = self.received, None
            return taken
        if self.in_flight is None:
            raise RuntimeError("DisaggregatedPhase.receive: no batch in flight")
        request, self.in_flight = self.in_flight, None
        return self.rollout.receive(request)

    def close(self) -> None:
        if self.in_flight is not None:  # the engines answer before they can be stopped
            self.receive()
        self.rollout.stop_engines()


def serve_engine_rank(config: RunConfig, runtime: Runtime) -> None:
    """An engine rank of the disaggregated placement: serves the trainers until they stop it."""
    channel = Channel.of_run(config, runtime)
    placement = config.rollout.placement

    def rebuild():
        return build_engine(config.model.path, engine_config(config, in_process=False), runtime.device)

    engine = rebuild()
    restarts = Restarts(rebuild, placement.max_engine_restarts, placement.engine_timeout_s)
    multi_turn = None
    if config.rollout.env is not None:  # the trainers loaded the same tokenizer already
        from transformers import AutoTokenizer

        multi_turn = _multi_turn(config, AutoTokenizer.from_pretrained(config.model.path))
    EngineServer(channel, engine, multi_turn, adapter_only=adapter_only(config), restarts=restarts).serve()


def _multi_turn(config: RunConfig, tokenizer) -> MultiTurnRollout:
    return MultiTurnRollout(config.rollout.env, tokenizer, uses_chat_template(tokenizer, config.data),
                            config.rollout.max_new_tokens, config.rollout.response_budget)


def build_rollout_phase(config: RunConfig, actor: TrainModel, others: list[TrainModel], tokenizer=None,
                        calibration: Calibration = Calibration()):
    """The rollout side for this trainer rank, as ``rollout.placement`` says (the gates calibrated, with
    ``calibration``'s prompts for the natural floor); with ``rollout.env`` its rollouts are multi-turn
    episodes (``tokenizer`` renders the observations)."""
    if config.rollout.placement.mode == "disaggregated":  # the engine ranks run the episodes
        return DisaggregatedPhase(config, actor, calibration)
    multi_turn = None
    if config.rollout.env is not None:
        if tokenizer is None:
            raise ValueError("build_rollout_phase: rollout.env (multi-turn rollouts) needs the tokenizer")
        multi_turn = _multi_turn(config, tokenizer)
    return RolloutPhase(config, actor, others, multi_turn, calibration)
