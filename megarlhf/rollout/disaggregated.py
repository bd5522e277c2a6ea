"""Disaggregated rollouts: trainer ranks and engine ranks are different processes; nothing is offloaded.

Selected by ``rollout.placement`` (``mode="disaggregated"``, ``num_engine_ranks=E``): of a job's
``W`` ranks, ``[0, W-E)`` hold the Megatron models (their groups come from
:func:`parallel.runtime.init_disaggregated`) and ``[W-E, W)`` hold one TP=1 vLLM engine each.

Why the engine runs out of process: building an in-process vLLM engine is collective over the job's
default process group (vLLM's world group spans every rank of it, ``vllm/distributed/parallel_state.py``
``init_distributed_environment`` -> ``init_world_group(range(world))`` and ``_node_count`` broadcasts
over it), so trainer ranks would have to join vLLM's start-up. With ``EngineConfig(in_process=False)``
vLLM's engine core and worker are spawned child processes of the engine rank with their own one-rank
torch.distributed world, and the engine rank only talks to the trainers over megarlhf's own groups.
Each bucket reaches the worker through vLLM's ``collective_rpc`` as a handle to shared memory.

Groups (made by :func:`parallel.runtime.init_disaggregated`): ``trainers`` = the trainer ranks;
``channel`` = {trainer rank 0, the *source*} + the engine ranks (gloo, for objects); ``payload`` = the
same ranks over the device's backend (for weight buckets). Engine ranks sit in
:meth:`DisaggregatedRollout.serve` and execute commands the source broadcasts on ``channel``; every
trainer rank calls :meth:`calibrate` / :meth:`sync` / :meth:`generate` / :meth:`stop_engines` together
(they are collective over the trainer ranks).

* ``sync(model)``: ``iter_hf_weights`` (collective over the trainer ranks) yields full HF tensors; the
  source packs them into buckets of at most ``bucket_mb`` and broadcasts each (a header of names, dtypes
  and shapes, then one flat byte buffer), fingerprinting each tensor at its place in the engine's
  parameters as it goes. Each engine rank passes every bucket to its engine core inside ONE
  layerwise-reload session of vLLM (begin; ``model.load_weights`` per bucket; finalize), the same
  in-place path as ``reload_weights``; the engine core then fingerprints the parameters it computes
  with, and the engine rank compares them with the source's, bit for bit. Then the probe forward: the
  trainers' log-probs of fixed random sequences (the training forward) vs each engine's prompt
  log-probs, gated by :mod:`megarlhf.rollout.gates`. The fingerprints, the bucketing and the probe comparison
  are :mod:`megarlhf.rollout.weight_sync`'s, shared with the colocated sync. A bucket never leaves
  the device: the source concatenates its tensors into one flat buffer on its device and broadcasts it
  over the ``payload`` group (NCCL between GPUs, gloo on CPU) into a buffer on each engine rank's
  device, which hands the engine core (another process) a handle to that memory, not its bytes
  (:mod:`megarlhf.rollout.shared_tensor`: CUDA IPC on a GPU, shared memory on CPU). The source collects
  every engine's problems and broadcasts the verdict to all ranks, which raise
  :class:`~megarlhf.rollout.weight_sync.WeightSyncError` together.
* ``generate(prompts, sampling)`` = ``receive(launch(prompts, sampling))``: the prompts of each data-
  parallel replica go to the source, are split round-robin over the engines (``launch`` returns as soon
  as they are sent, so the trainers can work while the engines generate: one-step off-policy training),
  and ``receive`` gives each trainer rank the :class:`RolloutBatch` of its
  replica's prompts. Each prompt keeps the seeds its own replica gave it (:func:`merged_sampling`,
  ``SamplingConfig.for_prompts``), so the samples depend neither on the number of engine ranks nor on
  the other replicas. With ``rollout.env`` the requests carry the prompts' :class:`PromptExample`\ s
  and each engine rank runs its share's whole multi-turn episodes (:mod:`megarlhf.rollout.multi_turn`):
  it generates every turn and runs the tools between turns, so a tool runs once per call whatever the
  trainers' layout, the trainers wait for finished episodes only, and multi-turn batches can be in
  flight while the trainers update (off-policy). The tool counts come back summed over the engines and
  are reported by the first data-parallel replica's ranks (the others report zeros, so that the usual
  sum over replicas gives the totals).

Hand-written because the rank layout, the wire protocol and the command loop are megarlhf's own; vLLM
generates and loads weights, torch.distributed moves the bytes.
"""
from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megarlhf.data.prompts import PromptExample, uses_chat_template
from megarlhf.core.dtypes import torch_dtype
from megarlhf.rollout.gates import run_tolerances
from megarlhf.rollout.adapter_sync import (SLOTS_CHECK, AdapterDirectory, adapter_metrics, adapter_only,
                                           engine_lora, expected_slots, load_problems, slot_problems)
from megarlhf.rollout.batch import RolloutBatch
from megarlhf.rollout.calibration import (CHECKPOINT_CHECK, FLOORS_CHECK, calibration_metrics, checkpoint_problems,
                                          checks_checkpoint, floor_problems, natural_gap, natural_sampling,
                                          trainer_fingerprints, worst_of)
from megarlhf.rollout.config import SamplingConfig, vllm_lora_rank
from megarlhf.rollout.engine import EngineConfig, RolloutEngine
from megarlhf.rollout.routing import engine_routing
from megarlhf.rollout.engine_weights import (ExpectedReloadNotices, ProcessingCapture, parameter_report,
                                             repack_experts, reprocess_tied, tied_modules)
from megarlhf.rollout.fingerprint import to_host
from megarlhf.rollout.multi_turn import MultiTurnRollout
from megarlhf.rollout.shared_tensor import open_shared, share, shared_buffer
from megarlhf.rollout.weight_sync import (ExpectedFingerprints, compare_fingerprints,
                                          engine_placement, layout_problems, longest_probe_length, probe_floor,
                                          probe_problems, probe_sequences, sync_metrics, trainer_probe_logprobs,
                                          verdict_error, weight_buckets)
from model_providers.peft_adapter import peft_config, peft_tensors
from parallel.lora import merge_rounding

SOURCE_RANK = 0  # the trainer rank that talks to the engines


@dataclass
class InFlight:
    """A generation request the engines are working on (:meth:`DisaggregatedRollout.launch`)."""

    order: list[tuple[int, int]]  # (data-parallel replica, prompt) of every prompt sent, in sending order
    replicas: dict[int, list]  # each replica's prompts (token ids, or PromptExamples of multi-turn episodes)
    max_new_tokens: dict[int, int]  # each replica's own limit (the engines generate for the largest)
    episodes: bool = False  # whole multi-turn episodes of PromptExamples, not single samples of token ids


def merged_sampling(samplings: dict[int, SamplingConfig], order: list[tuple[int, int]]) -> SamplingConfig:
    """One request's sampling for every replica's prompts (``order``: (replica, prompt) in sending order):
    each prompt keeps its own replica's seed; the engines generate up to the largest ``max_new_tokens``
    (:meth:`DisaggregatedRollout.receive` cuts each replica's samples at its own). Everything else must
    agree across replicas."""
    first = samplings[min(samplings)]
    plain = replace(first, seed=None, prompt_seeds=None, max_new_tokens=1)
    for dp, sampling in samplings.items():
        if replace(sampling, seed=None, prompt_seeds=None, max_new_tokens=1) != plain:
            raise ValueError(f"DisaggregatedRollout.generate: data-parallel replica {dp} samples with {sampling}, "
                             f"replica {min(samplings)} with {first}: only seeds and max_new_tokens may differ")
    seeds = None
    if any(s.seed is not None or s.prompt_seeds is not None for s in samplings.values()):
        seeds = tuple(samplings[dp].prompt_seed(i) for dp, i in order)
        if None in seeds:
            raise ValueError("DisaggregatedRollout.generate: some data-parallel replicas sample seeded, some not")
    asking = {dp for dp, _ in order} or set(samplings)  # a replica with no prompt asks for nothing
    return replace(first, seed=None, prompt_seeds=seeds,
                   max_new_tokens=max(samplings[dp].max_new_tokens for dp in asking))


# ---- the engine core's side (runs in vLLM's worker, i.e. the engine's child process) ---------------------
def _unpack(meta: list[tuple], payload: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, dtype, shape, nbytes) records + their concatenated bytes (uint8) -> named tensors (views)."""
    out, offset = [], 0
    for name, dtype, shape, nbytes in meta:
        chunk = payload[offset:offset + nbytes]
        out.append((name, chunk.view(getattr(torch, dtype.removeprefix("torch."))).view(shape)))
        offset += nbytes
    return out


def _worker_begin(worker) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    model = worker.model_runner.model
    worker.megarlhf_tied_modules = tied_modules(model)  # before the layerwise reload moves params to meta
    worker.megarlhf_capture = ProcessingCapture(model).__enter__()
    worker.megarlhf_notices = ExpectedReloadNotices(model).__enter__()
    initialize_layerwise_reload(model)


def _worker_load(worker, meta: list[tuple], handle: bytes) -> None:
    """In the engine core: loads one bucket from the engine rank's buffer (shared, not copied)."""
    payload = open_shared(handle)
    worker.model_runner.model.load_weights(_unpack(meta, payload))
    if payload.is_cuda:  # the engine rank reuses the memory once this call returns
        torch.cuda.synchronize()


def _worker_finish(worker) -> dict:
    """Ends the reload session; returns the fingerprints of the parameters the engine now computes with."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    model, capture = worker.model_runner.model, worker.megarlhf_capture
    try:
        finalize_layerwise_reload(model, worker.model_runner.model_config)
        reprocess_tied(worker.megarlhf_tied_modules)  # see engine_weights.tied_modules: vLLM skips tied heads
    finally:
        capture.__exit__(None, None, None)
        worker.megarlhf_notices.__exit__(None, None, None)
    report = parameter_report(model, capture, worker.model_runner.model_config.dtype)
    repack_experts(model)  # after the report: see engine_weights.repack_experts
    return report


def _worker_layout(worker) -> tuple[dict[str, list[str]], dict[str, tuple[str, int]]]:
    """The engine's fused modules and its stacked experts' placement (:mod:`megarlhf.rollout.engine_weights`)."""
    from megarlhf.rollout.engine_weights import expert_placement, fused_parameters

    return fused_parameters(worker.model_runner.model), expert_placement(worker.model_runner.model)


class DisaggregatedRollout:
    """This rank's part of the disaggregated rollout (see the module docstring). Collective to build."""

    def __init__(self, config, runtime, actor=None):
        """``config``: the run's ``RunConfig``; ``actor``: the trainer's TrainModel (trainer ranks only)."""
        placement = config.rollout.placement
        if placement.mode != "disaggregated":
            raise ValueError(f"DisaggregatedRollout needs rollout.placement.mode='disaggregated', "
                             f"got {placement.mode!r}")
        if not dist.is_initialized():
            raise RuntimeError("DisaggregatedRollout: torch.distributed is not initialised "
                               "(call parallel.runtime.init_disaggregated first)")
        self.config, self.runtime, self.tolerances = config, runtime, run_tolerances(config)
        self.rank, world = runtime.launch.rank, runtime.launch.world_size
        self.num_trainers = placement.num_trainer_ranks(world)
        self.engine_ranks = list(range(self.num_trainers, world))
        self.is_engine_rank = self.rank >= self.num_trainers
        self.sync_config = config.rollout.weight_sync
        # the groups parallel.runtime.init_disaggregated made: the trainers (for the trainer side's
        # broadcasts), the gloo channel between the source and the engine ranks (objects) and the payload
        # group over the same ranks (weight buckets as device tensors: NCCL on CUDA, gloo on CPU)
        self.trainers, self.channel = runtime.trainers.group, runtime.channel.group
        self.payload = runtime.payload.group
        self.engine = self.actor = self.multi_turn = None
        # LoRA adapters reach the engines instead of merged weights (megarlhf.rollout.adapter_sync)
        self.adapter_only = adapter_only(config)
        if self.is_engine_rank:
            if config.rollout.tensor_parallel_size != 1 or config.rollout.backend != "vllm":
                raise ValueError("DisaggregatedRollout: engines are TP=1 vLLM engines (one per engine rank); got "
                                 f"rollout.tensor_parallel_size={config.rollout.tensor_parallel_size}, "
                                 f"rollout.backend={config.rollout.backend!r}")
            self.engine = RolloutEngine(config.model.path, EngineConfig.from_rollout(
                config.rollout, model_dtype=config.model.dtype, seed=config.seed,
                max_prompt_length=config.data.max_prompt_length, in_process=False, **engine_lora(config),
                **engine_routing(config)))
            self.adapter_directory = AdapterDirectory() if self.adapter_only else None
            self.multi_turn = _engine_multi_turn(config)
        else:
            if actor is None:
                raise ValueError(f"DisaggregatedRollout: trainer rank {self.rank} needs the actor")
            self.actor = actor
            self.hf_shapes = actor.provider.hf_tensor_shapes("lm")
            self.expected = set(self.hf_shapes)
            self.engine_dtype = torch_dtype(config.rollout.engine_dtype(config.model.dtype))
            self.placement = self.fused = None  # the engines' layout (the source's), asked for once
            self.probe = probe_sequences(actor.provider.hf_config.vocab_size, self.sync_config,
                                         longest_probe_length(config))

    # ---- plumbing ------------------------------------------------------------------------------------
    def _require(self, engine_side: bool, what: str) -> None:
        if self.is_engine_rank != engine_side:
            side = "engine" if engine_side else "trainer"
            raise RuntimeError(f"DisaggregatedRollout.{what} runs on {side} ranks only (this is rank {self.rank})")

    def _channel_bcast(self, obj=None):
        box = [obj]
        dist.broadcast_object_list(box, src=SOURCE_RANK, group=self.channel)
        return box[0]

    def _trainer_bcast(self, obj=None):
        box = [obj]
        dist.broadcast_object_list(box, src=SOURCE_RANK, group=self.trainers)
        return box[0]

    def _from_engines(self, obj=None) -> list:
        """Gathers one object per engine rank at the source (the source's own entry is dropped)."""
        out = [None] * (len(self.engine_ranks) + 1) if self.rank == SOURCE_RANK else None
        dist.gather_object(obj, out, dst=SOURCE_RANK, group=self.channel)
        return out[1:] if out is not None else []

    # ---- engine ranks --------------------------------------------------------------------------------
    def serve(self) -> None:
        """Engine ranks: executes the source's commands until :meth:`stop_engines`. A failed sync raises
        :class:`WeightSyncError` here after the trainers were told."""
        self._require(True, "serve")
        while True:
            command = self._channel_bcast()
            if command[0] == "stop":
                if self.multi_turn is not None:
                    self.multi_turn.close()
                return
            if command[0] == "sync":
                self._serve_sync()
            elif command[0] == "adapter":
                self._serve_adapter(command[1])
            elif command[0] == "layout":
                self._from_engines(self.engine.run_in_worker(_worker_layout))
            elif command[0] == "checkpoint":
                self._serve_checkpoint(command[1])
            elif command[0] == "calibrate":
                self._from_engines(probe_floor(command[2], self.engine.prompt_logprobs(command[1])))
            elif command[0] == "generate":
                self._serve_generate(*command[1:])
            else:
                raise RuntimeError(f"DisaggregatedRollout.serve: unknown command {command[0]!r} from the source")

    def _receive_bucket(self) -> tuple[list, torch.Tensor] | None:
        header = self._channel_bcast()
        if not header:
            return None
        buffer = shared_buffer(sum(h[3] for h in header), self.runtime.device)
        dist.broadcast(buffer, src=SOURCE_RANK, group=self.payload)
        return header, buffer

    def _load_bucket(self, meta: list[tuple], payload: torch.Tensor) -> None:
        """Hands one bucket to the engine core (another process) as a handle to its memory."""
        self.engine.run_in_worker(functools.partial(_worker_load, meta=meta, handle=share(payload)))

    def _serve_sync(self) -> None:
        problems = []
        self.engine.run_in_worker(_worker_begin)
        while (bucket := self._receive_bucket()) is not None:
            header, buffer = bucket
            try:
                self._load_bucket(header, buffer)
            except Exception as err:  # keep draining the stream so that every rank reaches the verdict
                problems.append(f"the engine failed to load the bucket with {header[0][0]}...: {err}")
        report = self.engine.run_in_worker(_worker_finish)
        self.engine.llm.reset_prefix_cache()
        problems += compare_fingerprints(self._channel_bcast(), report)  # the source's expected fingerprints
        self._verdict(problems, "fingerprints of the engine's parameters")
        self._serve_probe()

    def _serve_adapter(self, adapter_config: dict) -> None:
        """Adapter-only sync: one bucket of PEFT tensors, written and loaded as the engine's adapter, its
        slots compared with the source's prediction (megarlhf.rollout.adapter_sync); then the probe."""
        bucket = self._receive_bucket()
        if bucket is None:
            report, problems = {}, ["the source sent no adapter tensors"]
        else:
            report, problems = load_problems(self.adapter_directory, self.engine, dict(_unpack(*bucket)),
                                             adapter_config)
        expected = self._channel_bcast()  # the source's expected slots
        self._verdict(problems or slot_problems(expected, report), SLOTS_CHECK)
        self._serve_probe()

    def _serve_probe(self) -> None:
        probe, gaps, problems = self._channel_bcast(), (float("nan"), float("nan")), []
        if probe is not None:
            ids, trainer, tolerances = probe
            worst, mean, problems = probe_problems(trainer, self.engine.prompt_logprobs(ids), tolerances)
            gaps = (worst, mean)
        self._verdict(problems, "probe forward", metric=gaps)

    def _serve_checkpoint(self, expected: dict[str, tuple[int, int]]) -> None:
        """The calibration's bitwise check: the engine reloads model.path from disk and compares."""
        self._verdict(checkpoint_problems(expected, self.engine.checkpoint_report()), CHECKPOINT_CHECK)

    def _serve_generate(self, prompts: list, sampling: SamplingConfig, episodes: bool) -> None:
        """This engine rank's share of a request: samples of token-id prompts, or (``episodes``) whole
        multi-turn episodes of PromptExamples, with their tool counts."""
        index = self.engine_ranks.index(self.rank)
        mine = list(range(index, len(prompts), len(self.engine_ranks)))
        samples, tools, start = [], {}, time.perf_counter()
        if mine:
            share, local = [prompts[i] for i in mine], sampling.for_prompts(mine)
            if episodes:
                batch, tools = self.multi_turn.run(self.engine.generate, share, local)
            else:
                batch = self.engine.generate(share, local)
            extras = (zip(batch.loss_masks, batch.env_rewards, batch.tool_calls) if episodes
                      else itertools.repeat((None, None, None)))  # (loss mask, env reward, tool calls) of an episode
            routing = batch.routed_experts or itertools.repeat(None)  # routing records (replay r3)
            samples = [(mine[p], r, lp, f, *extra, record) for p, r, lp, f, extra, record in
                       zip(batch.prompt_index, batch.response_ids, batch.logprobs, batch.finish_reasons, extras,
                           routing)]
        self._from_engines((samples, time.perf_counter() - start, tools))

    def _verdict(self, problems: list[str], what: str, metric=None) -> None:
        """Engine ranks: report problems to the source and raise if any engine had one."""
        self._from_engines((problems, metric))
        lines = self._channel_bcast()
        if lines:
            raise verdict_error(lines, what)

    # ---- trainer ranks -------------------------------------------------------------------------------
    def _trainer_verdict(self, problems: list[str], what: str) -> list:
        """Trainer ranks: the source merges its own and the engines' problems and tells everyone."""
        metrics = []
        if self.rank == SOURCE_RANK:
            reports = self._from_engines()
            lines = [f"rank {SOURCE_RANK}: {p}" for p in problems]
            for rank, (found, metric) in zip(self.engine_ranks, reports):
                lines += [f"rank {rank}: {p}" for p in found]
                metrics.append(metric)
            self._channel_bcast(lines)
        lines, metrics = self._trainer_bcast((lines, metrics) if self.rank == SOURCE_RANK else None)
        if lines:
            raise verdict_error(lines, what)
        return metrics

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        header = [(name, str(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for name, t in bucket]
        self._channel_bcast(header)
        # one flat buffer on the trainer's device: NCCL carries it between GPUs, gloo on CPU
        buffer = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for _, t in bucket])
        dist.broadcast(buffer, src=SOURCE_RANK, group=self.payload)

    def calibrate(self, prompts: list[list[int]] = (), stop_token_ids: tuple[int, ...] = ()) -> dict[str, float]:
        """Trainer ranks (all together): the gates' calibration (:mod:`megarlhf.rollout.calibration`)
        against every engine while it holds the checkpoint it loaded itself; ``prompts`` (token ids, the
        same on every rank) are sampled for the natural floor. Returns the calibration metrics."""
        self._require(False, "calibrate")
        source = self.rank == SOURCE_RANK
        checked = checks_checkpoint(self.config)
        if checked:
            expected = trainer_fingerprints(self.actor, self._engine_layout(), self.engine_dtype)  # collective
            if source:
                self._channel_bcast(("checkpoint", expected))
            self._trainer_verdict([], CHECKPOINT_CHECK)
        floor = natural = None
        if self.probe:
            trainer = trainer_probe_logprobs(self.actor, self.probe, self.config)  # every trainer rank
            if source:
                self._channel_bcast(("calibrate", self.probe, trainer))
                floor = worst_of(self._from_engines())
            floor = self._trainer_bcast(floor)
        if prompts:  # every replica sends the same prompts: each scores the samples it received
            batch = self.generate(list(prompts), natural_sampling(self.config, stop_token_ids))
            natural = worst_of(self.runtime.all_gather_objects(natural_gap(self.actor, batch, self.config),
                                                               over="trainers"))
        problems = floor_problems(self.config, floor, natural)
        if problems:
            raise verdict_error(problems, FLOORS_CHECK)
        self.tolerances = run_tolerances(self.config, floor, natural)
        return calibration_metrics(floor, natural, checked, self.tolerances)

    def _engine_layout(self) -> dict[str, tuple[str, int]] | None:
        """Trainer ranks: where each HF tensor sits in the engines' parameters (asked once; the source's)."""
        if self.rank == SOURCE_RANK and self.placement is None:
            self._channel_bcast(("layout",))
            self.fused, experts = self._from_engines()[0]  # every engine runs the same model class
            self.placement = {**engine_placement(self.hf_shapes, self.fused), **experts}
        return self.placement

    def sync(self) -> dict[str, float]:
        """Trainer ranks (all together): pushes the actor's weights to every engine, verified; returns
        metrics. Raises :class:`WeightSyncError` on every rank if any engine received something else."""
        from model_providers.hf_checkpoint import iter_hf_weights

        self._require(False, "sync")
        if self.adapter_only:
            return {**self._sync_adapter(), **self._probe_forward()}
        source = self.rank == SOURCE_RANK
        if source:
            placement = self._engine_layout()
            self._channel_bcast(("sync",))
            expected = ExpectedFingerprints(placement, self.engine_dtype)
        sent, stats = [], {}
        start = time.perf_counter()
        weights = iter_hf_weights(self.actor.model, self.actor.provider, copies=False)  # collective (trainers)
        for bucket in weight_buckets(weights, self.sync_config.bucket_mb, stats):
            if source:
                expected.add_bucket(bucket)
                self._send_bucket(bucket)
                sent += [name for name, _ in bucket]
        problems = []
        if source:
            self._channel_bcast([])  # end of stream
            self._channel_bcast(expected.result())
            problems = layout_problems(sent, self.expected)
        self._trainer_verdict(problems, "fingerprints of the engine's parameters")
        metrics = self._trainer_bcast(sync_metrics(stats, len(sent), time.perf_counter() - start) if source else None)
        rounding = merge_rounding(self.actor.model)  # this trainer rank's adapters (LoRA), as in colocated syncs
        if rounding is not None:
            metrics["weight_sync/lora_merge_rounding"] = rounding
        return {**metrics, **self._probe_forward()}

    def _sync_adapter(self) -> dict[str, float]:
        """Adapter-only sync (megarlhf.rollout.adapter_sync): the source sends the adapters as one bucket and
        its prediction of every engine's adapter slots; returns the sync's metrics."""
        source, lora = self.rank == SOURCE_RANK, self.config.model.lora
        if source:
            self._engine_layout()
        start, problems = time.perf_counter(), []
        tensors = peft_tensors(self.actor.model, self.actor.provider, lora)  # collective over the trainer ranks
        if source:
            try:  # predicted before anything is sent: an error here still follows the protocol below
                host = {name: t.detach().cpu() for name, t in tensors.items()}  # host: predicted as vLLM computes
                expected = to_host(expected_slots(host, self.fused, max_rank=vllm_lora_rank(lora.rank),
                                                  dtype=self.engine_dtype, scale=lora.scale))
            except Exception as err:  # noqa: BLE001 - every rank raises with it at the verdict
                expected, problems = {}, [f"the trainer could not predict the engines' adapter slots: {err}"]
            self._channel_bcast(("adapter", peft_config(self.actor.provider, lora, self.config.model.path)))
            self._send_bucket(list(tensors.items()))  # from the trainer's device, as weight buckets travel
            self._channel_bcast(expected)
        self._trainer_verdict(problems, SLOTS_CHECK)
        return self._trainer_bcast(adapter_metrics(tensors, time.perf_counter() - start) if source else None)

    def _probe_forward(self) -> dict[str, float]:
        """Trainer ranks: the probe forward after a sync (every engine against the trainers' log-probs)."""
        metrics, start, probe = {}, time.perf_counter(), None
        source = self.rank == SOURCE_RANK
        if self.sync_config.probe_sequences:
            trainer = trainer_probe_logprobs(self.actor, self.probe, self.config)  # every trainer rank
            probe = (self.probe, trainer, self.tolerances)
        if source:
            self._channel_bcast(probe)
        gaps = self._trainer_verdict([], "probe forward")
        if probe is not None:
            metrics.update({"weight_sync/probe_max_abs_diff": max(g[0] for g in gaps),
                            "weight_sync/probe_mean_abs_diff": max(g[1] for g in gaps),
                            "time/weight_sync_probe_s": time.perf_counter() - start})
        return metrics

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        """Trainer ranks (all together): samples for this rank's data-parallel replica's ``prompts``.

        Ranks of one replica (its TP/PP/CP peers) must pass the same prompts and ``sampling``; each
        replica's prompts keep their own seeds (:func:`merged_sampling`). ``prompt_index`` in the result
        indexes this rank's ``prompts``.
        """
        return self.receive(self.launch(prompts, sampling))[0]

    def launch(self, prompts: list, sampling: SamplingConfig, episodes: bool = False) -> "InFlight":
        """Trainer ranks (all together): sends the request of :meth:`generate` to the engines and returns
        at once; the engines generate while the trainers go on. Nothing else may use the engines until
        :meth:`receive` took the batch. ``episodes``: ``prompts`` are PromptExamples whose whole multi-turn
        episodes (``rollout.env``) the engine ranks run; else token ids, one model turn per sample."""
        self._require(False, "launch")
        sampling.validate(len(prompts))
        if episodes and (self.config.rollout.env is None or not all(isinstance(p, PromptExample) for p in prompts)):
            raise TypeError("DisaggregatedRollout.launch: episodes need rollout.env and PromptExamples")
        dp_rank = self.runtime.dp.rank
        everyone = [None] * self.num_trainers
        sent = list(prompts) if episodes else [list(map(int, p)) for p in prompts]  # PromptExamples pickle whole
        dist.all_gather_object(everyone, (dp_rank, sent, sampling), group=self.trainers)
        replicas: dict[int, list[list[int]]] = {}
        samplings: dict[int, SamplingConfig] = {}
        for rank, (dp, theirs, their_sampling) in enumerate(everyone):
            if (replicas.setdefault(dp, theirs), samplings.setdefault(dp, their_sampling)) != (theirs, their_sampling):
                raise ValueError(f"DisaggregatedRollout.generate: trainer rank {rank} passed prompts or sampling "
                                 f"that differ from its data-parallel replica {dp}'s (its model-parallel peers "
                                 f"must agree)")
        order = [(dp, i) for dp in sorted(replicas) for i in range(len(replicas[dp]))]
        merged = merged_sampling(samplings, order)  # on every trainer rank: a refusal raises on all of them
        if self.rank == SOURCE_RANK:
            self._channel_bcast(("generate", [replicas[dp][i] for dp, i in order], merged, episodes))
        return InFlight(order, replicas, {dp: s.max_new_tokens for dp, s in samplings.items()}, episodes)

    def receive(self, request: "InFlight") -> tuple[RolloutBatch, dict[str, float]]:
        """Trainer ranks (all together): waits for the batch :meth:`launch` asked for; returns this rank's
        share and ``time/rollout_wait_s`` (how long the trainers waited here) and ``time/engine_generate_s``
        (the slowest engine's generation time)."""
        self._require(False, "receive")
        start, samples = time.perf_counter(), None
        if self.rank == SOURCE_RANK:
            parts = self._from_engines()
            generate_s = max(seconds for _, seconds, _ in parts)
            tools: dict[str, float] = {}
            for _, _, part in parts:
                for name, value in part.items():
                    tools[name] = tools.get(name, 0.0) + value
            samples = (sorted((s for part, _, _ in parts for s in part), key=lambda s: s[0]), generate_s, tools)
        samples, generate_s, tools = self._trainer_bcast(samples)
        dp_rank, batch, episodes = self.runtime.dp.rank, RolloutBatch(), request.episodes
        limit = request.max_new_tokens.get(dp_rank)
        for item, response, logprobs, finish, mask, env_reward, calls, record in samples:  # stable sort: order kept
            dp, i = request.order[item]
            if dp != dp_rank:
                continue
            prompt = request.replicas[dp][i]
            if not episodes and len(response) > limit:  # generated for another replica's larger limit: cut
                response, logprobs, finish = response[:limit], logprobs[:limit], "length"
                record = None if record is None else record[:len(prompt) + limit]
            if record is not None:
                batch.routed_experts.append(record)
            batch.prompt_index.append(i)
            batch.prompt_ids.append(list(prompt.prompt_ids) if episodes else prompt)
            batch.response_ids.append(list(response))
            batch.logprobs.append(list(logprobs))
            batch.finish_reasons.append(finish)
            if episodes:
                batch.loss_masks.append(list(mask))
                batch.env_rewards.append(env_reward)
                batch.tool_calls.append(calls)
        # the engines' totals, reported once: replica 0's ranks carry them, the others zeros (summed over replicas)
        tools = {name: value if dp_rank == 0 else 0.0 for name, value in tools.items()}
        return batch, {"time/rollout_wait_s": time.perf_counter() - start, "time/engine_generate_s": generate_s,
                       **tools}

    def stop_engines(self) -> None:
        """Trainer ranks: ends the engines' :meth:`serve` loop (call once, from every trainer rank)."""
        self._require(False, "stop_engines")
        if self.rank == SOURCE_RANK:
            self._channel_bcast(("stop",))


def _engine_multi_turn(config) -> MultiTurnRollout | None:
    """An engine rank's multi-turn episode runner (with the run's tokenizer), None for single-turn runs."""
    if config.rollout.env is None:
        return None
    from transformers import AutoTokenizer  # the trainers loaded the same directory already

    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    return MultiTurnRollout(config.rollout.env, tokenizer, uses_chat_template(tokenizer, config.data),
                            config.rollout.max_new_tokens, config.rollout.response_budget)
