"""Disaggregated rollouts: trainer ranks and engine ranks are different processes; nothing is offloaded.

Selected by :class:`RolloutPlacementConfig` (``mode="disaggregated"``, ``num_engine_ranks=E``): of a job's
``W`` ranks, ``[0, W-E)`` hold the Megatron models (their groups come from
:func:`parallel.runtime.init_disaggregated`) and ``[W-E, W)`` hold one TP=1 vLLM engine each.

Why the engine runs out of process: building an in-process vLLM engine is collective over the job's
default process group (vLLM's world group spans every rank of it, ``vllm/distributed/parallel_state.py``
``init_distributed_environment`` -> ``init_world_group(range(world))`` and ``_node_count`` broadcasts
over it), so trainer ranks would have to join vLLM's start-up. With ``EngineConfig(in_process=False)``
vLLM's engine core and worker are spawned child processes of the engine rank with their own one-rank
torch.distributed world, and the engine rank only talks to the trainers over megarlhf's own groups.
Bytes reach the worker through vLLM's ``collective_rpc`` (pickled), one bucket per call.

Groups (created by every rank in the constructor): ``trainers`` = the trainer ranks, and ``channel`` =
{trainer rank 0, the *source*} + the engine ranks. Engine ranks sit in :meth:`DisaggregatedRollout.serve`
and execute commands the source broadcasts on ``channel``; every trainer rank calls :meth:`sync` /
:meth:`generate` / :meth:`stop_engines` together (they are collective over the trainer ranks).

* ``sync(model)``: ``iter_hf_weights`` (collective over the trainer ranks) yields full HF tensors; the
  source packs them into buckets of at most ``bucket_mb`` and broadcasts each (a header of names, dtypes,
  shapes and trainer-side checksums, then one flat byte buffer). Each engine rank passes every bucket to
  its engine core inside ONE layerwise-reload session of vLLM (begin; ``model.load_weights`` per bucket;
  finalize), the same in-place path as ``reload_weights``, checksumming each tensor as vLLM's loader
  takes it (:func:`~megarlhf.rollout.weight_sync.tensor_checksum` /
  :func:`~megarlhf.rollout.weight_sync.compare_checksums`). Then the probe forward: the source's
  teacher-forced log-probs of fixed random sequences vs each engine's prompt log-probs. The source
  collects every engine's problems and broadcasts the verdict to all ranks, which raise
  :class:`~megarlhf.rollout.weight_sync.WeightSyncError` together.
* ``generate(prompts, sampling)``: the prompts of each data-parallel replica go to the source, are split
  round-robin over the engines, and each trainer rank gets back the :class:`RolloutBatch` of its
  replica's prompts. Seeded sampling is reproducible for a fixed number of engine ranks.

Hand-written because the rank layout, the wire protocol and the command loop are megarlhf's own; vLLM
generates and loads weights, torch.distributed moves the bytes.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.distributed as dist

from megarlhf.rollout.engine import EngineConfig, RolloutBatch, RolloutEngine, SamplingConfig, _tied_modules
from megarlhf.rollout.weight_sync import (WeightSyncConfig, WeightSyncError, compare_checksums,
                                          tensor_checksum)

SOURCE_RANK = 0  # the trainer rank that talks to the engines


@dataclass(frozen=True)
class RolloutPlacementConfig:
    """Where rollout engines live. ``colocate``: on every rank, with the trainers (offload around
    rollouts). ``disaggregated``: on the last ``num_engine_ranks`` ranks, trainers on the others."""

    mode: Literal["colocate", "disaggregated"] = "colocate"
    num_engine_ranks: int = 0  # disaggregated only

    def validate(self, world_size: int) -> None:
        if self.mode not in ("colocate", "disaggregated"):
            raise ValueError(f"RolloutPlacementConfig.mode={self.mode!r}: must be 'colocate' or 'disaggregated'")
        if self.mode == "colocate" and self.num_engine_ranks != 0:
            raise ValueError(f"RolloutPlacementConfig.num_engine_ranks={self.num_engine_ranks}: only the "
                             f"disaggregated mode has separate engine ranks (colocate needs 0)")
        if self.mode == "disaggregated" and not 1 <= self.num_engine_ranks < world_size:
            raise ValueError(f"RolloutPlacementConfig.num_engine_ranks={self.num_engine_ranks}: the disaggregated "
                             f"mode needs at least 1 engine rank and 1 trainer rank out of {world_size} ranks")

    def num_trainer_ranks(self, world_size: int) -> int:
        self.validate(world_size)
        return world_size - self.num_engine_ranks


# ---- the engine core's side (runs in vLLM's worker, i.e. the engine's child process) ---------------------
def _unpack(meta: list[tuple], payload) -> list[tuple[str, torch.Tensor]]:
    """(name, dtype, shape, nbytes) records + their concatenated bytes -> named tensors (views)."""
    raw = payload if torch.is_tensor(payload) else torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    out, offset = [], 0
    for name, dtype, shape, nbytes in meta:
        chunk = raw[offset:offset + nbytes]
        out.append((name, chunk.view(getattr(torch, dtype.removeprefix("torch."))).view(shape)))
        offset += nbytes
    return out


def _worker_begin(worker) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    model = worker.model_runner.model
    worker.megarlhf_tied_modules = _tied_modules(model)  # before the layerwise reload moves params to meta
    initialize_layerwise_reload(model)


def _worker_load(worker, meta: list[tuple], payload: bytes) -> dict[str, tuple]:
    received = {}

    def arriving():
        for name, tensor in _unpack(meta, payload):
            received[name] = tensor_checksum(tensor)
            yield name, tensor

    worker.model_runner.model.load_weights(arriving())
    return received


def _worker_finish(worker) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(worker.model_runner.model, worker.model_runner.model_config)
    for module in worker.megarlhf_tied_modules:  # see engine._tied_modules: vLLM skips tied heads
        module.quant_method.process_weights_after_loading(module)


def _as_checksum(value) -> tuple[str, tuple[int, ...], int]:
    """A checksum back from the engine process (msgpack may turn tuples into lists)."""
    dtype, shape, crc = value
    return str(dtype), tuple(int(s) for s in shape), int(crc)


def _verdict_error(lines: list[str], what: str) -> WeightSyncError:
    shown = "\n  ".join(lines[:20]) + (f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else "")
    return WeightSyncError(f"weight sync verification failed ({what}):\n  {shown}")


class DisaggregatedRollout:
    """This rank's part of the disaggregated rollout (see the module docstring). Collective to build."""

    def __init__(self, placement: RolloutPlacementConfig, hf_dir: str, provider=None,
                 engine_config: EngineConfig = EngineConfig(in_process=False),
                 sync_config: WeightSyncConfig = WeightSyncConfig()):
        if placement.mode != "disaggregated":
            raise ValueError(f"DisaggregatedRollout needs RolloutPlacementConfig.mode='disaggregated', "
                             f"got {placement.mode!r}")
        if not dist.is_initialized():
            raise RuntimeError("DisaggregatedRollout: torch.distributed is not initialised "
                               "(call parallel.runtime.init_disaggregated first)")
        sync_config.validate()
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.num_trainers = placement.num_trainer_ranks(world)
        self.engine_ranks = list(range(self.num_trainers, world))
        self.is_engine_rank = self.rank >= self.num_trainers
        self.sync_config = sync_config
        # every rank creates both groups, in the same order (new_group is collective over the default group)
        self.trainers = dist.new_group(list(range(self.num_trainers)), backend="gloo")
        self.channel = dist.new_group([SOURCE_RANK, *self.engine_ranks], backend="gloo")
        self.engine = self.provider = None
        if self.is_engine_rank:
            if engine_config.tensor_parallel_size != 1:
                raise ValueError("DisaggregatedRollout: engines are TP=1 (one per engine rank); got "
                                 f"EngineConfig.tensor_parallel_size={engine_config.tensor_parallel_size}")
            self.engine = RolloutEngine(hf_dir, replace(engine_config, in_process=False))
        else:
            if provider is None:
                raise ValueError(f"DisaggregatedRollout: trainer rank {self.rank} needs the model provider")
            self.provider = provider
            self.expected = set(provider.hf_tensor_shapes("lm"))
            gen = torch.Generator().manual_seed(sync_config.probe_seed)
            self.probe = torch.randint(0, provider.hf_config.vocab_size,
                                       (sync_config.probe_sequences, sync_config.probe_length), generator=gen)

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
                return
            if command[0] == "sync":
                self._serve_sync()
            elif command[0] == "generate":
                self._serve_generate(*command[1:])
            else:
                raise RuntimeError(f"DisaggregatedRollout.serve: unknown command {command[0]!r} from the source")

    def _receive_bucket(self) -> tuple[list, torch.Tensor] | None:
        header = self._channel_bcast()
        if not header:
            return None
        buffer = torch.empty(sum(h[3] for h in header), dtype=torch.uint8)
        dist.broadcast(buffer, src=SOURCE_RANK, group=self.channel)
        return header, buffer

    def _load_bucket(self, meta: list[tuple], payload: torch.Tensor) -> dict[str, tuple]:
        """Hands one bucket to the engine core; returns the checksums of what its loader took."""
        call = functools.partial(_worker_load, meta=meta, payload=payload.numpy().tobytes())
        received = self.engine.run_in_worker(call)
        return {name: _as_checksum(c) for name, c in received.items()}

    def _serve_sync(self) -> None:
        sent, received, problems = {}, {}, []
        self.engine.run_in_worker(_worker_begin)
        while (bucket := self._receive_bucket()) is not None:
            header, buffer = bucket
            sent.update({name: (dtype, tuple(shape), crc) for name, dtype, shape, _, crc in header})
            try:
                received.update(self._load_bucket([h[:4] for h in header], buffer))
            except Exception as err:  # keep draining the stream so that every rank reaches the verdict
                problems.append(f"the engine failed to load the bucket with {header[0][0]}...: {err}")
        self.engine.run_in_worker(_worker_finish)
        self.engine.llm.reset_prefix_cache()
        problems += compare_checksums(sent, received)
        self._verdict(problems, "checksums of the tensors the engine received")
        probe, diff, problems = self._channel_bcast(), float("nan"), []
        if probe is not None:
            ids, trainer = probe
            engine = torch.tensor(self.engine.prompt_logprobs(ids), dtype=torch.float32)
            diff = float((engine - trainer).abs().max())
            if not diff <= self.sync_config.probe_tolerance:  # also catches nan
                problems.append(f"probe forward: engine vs trainer log-prob max |diff| {diff:.3g} > tolerance "
                                f"{self.sync_config.probe_tolerance:g}")
        self._verdict(problems, "probe forward", metric=diff)

    def _serve_generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> None:
        index = self.engine_ranks.index(self.rank)
        mine = list(range(index, len(prompts), len(self.engine_ranks)))
        samples = []
        if mine:
            batch = self.engine.generate([prompts[i] for i in mine], sampling)
            samples = [(mine[p], r, lp, f) for p, r, lp, f in
                       zip(batch.prompt_index, batch.response_ids, batch.logprobs, batch.finish_reasons)]
        self._from_engines(samples)

    def _verdict(self, problems: list[str], what: str, metric: float = float("nan")) -> None:
        """Engine ranks: report problems to the source and raise if any engine had one."""
        self._from_engines((problems, metric))
        lines = self._channel_bcast()
        if lines:
            raise _verdict_error(lines, what)

    # ---- trainer ranks -------------------------------------------------------------------------------
    def _trainer_verdict(self, problems: list[str], what: str) -> list[float]:
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
            raise _verdict_error(lines, what)
        return metrics

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], stats: dict) -> None:
        header = [(name, str(t.dtype), tuple(t.shape), t.numel() * t.element_size(), tensor_checksum(t)[2])
                  for name, t in bucket]
        self._channel_bcast(header)
        buffer = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8).cpu() for _, t in bucket])
        dist.broadcast(buffer, src=SOURCE_RANK, group=self.channel)
        stats["buckets"] += 1
        stats["bytes"] += buffer.numel()
        stats["max_bucket_bytes"] = max(stats["max_bucket_bytes"], buffer.numel())

    def sync(self, model: torch.nn.Module) -> dict[str, float]:
        """Trainer ranks (all together): pushes ``model``'s weights to every engine, verified; returns
        metrics. Raises :class:`WeightSyncError` on every rank if any engine received something else."""
        from model_providers.hf_checkpoint import iter_hf_weights

        self._require(False, "sync")
        source = self.rank == SOURCE_RANK
        if source:
            self._channel_bcast(("sync",))
        limit, sent = int(self.sync_config.bucket_mb * 2**20), []
        stats = {"buckets": 0, "bytes": 0, "max_bucket_bytes": 0}
        start = time.perf_counter()
        bucket, size = [], 0
        for name, tensor in iter_hf_weights(model, self.provider):  # collective over the trainer ranks
            if not source:
                continue
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > limit:
                self._send_bucket(bucket, stats)
                bucket, size = [], 0
            bucket.append((name, tensor))
            sent.append(name)
            size += nbytes
        problems = []
        if source:
            if bucket:
                self._send_bucket(bucket, stats)
            self._channel_bcast([])  # end of stream
            if set(sent) != self.expected:
                problems.append(f"the trainer sent {sorted(set(sent) - self.expected)} beyond the HF layout and "
                                f"lacks {sorted(self.expected - set(sent))}")
        self._trainer_verdict(problems, "checksums of the tensors the engine received")
        sync_s = time.perf_counter() - start
        metrics = {"time/weight_sync_s": sync_s, "weight_sync/bytes": float(stats["bytes"]),
                   "weight_sync/bytes_per_s": stats["bytes"] / max(sync_s, 1e-9),
                   "weight_sync/tensors": float(len(sent)), "weight_sync/buckets": float(stats["buckets"]),
                   "weight_sync/max_bucket_bytes": float(stats["max_bucket_bytes"])}
        metrics = self._trainer_bcast(metrics if source else None)
        start = time.perf_counter()
        probe = None
        if self.sync_config.probe_sequences:
            vocab = self.provider.hf_config.vocab_size
            from megarlhf.rollout.logprobs import token_logprobs

            probe = (self.probe.tolist(), token_logprobs(model, self.probe, vocab_size=vocab).cpu())
        if source:
            self._channel_bcast(probe)
        diffs = self._trainer_verdict([], "probe forward")
        if probe is not None:
            metrics["weight_sync/probe_max_abs_diff"] = max(diffs)
            metrics["time/weight_sync_probe_s"] = time.perf_counter() - start
        return metrics

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        """Trainer ranks (all together): samples for this rank's data-parallel replica's ``prompts``.

        Ranks of one replica (its TP/PP/CP peers) must pass the same prompts; the source's ``sampling``
        is used for everyone. ``prompt_index`` in the result indexes this rank's ``prompts``.
        """
        from megatron.core import parallel_state as ps

        self._require(False, "generate")
        sampling.validate()
        dp_rank = ps.get_data_parallel_rank()
        everyone = [None] * self.num_trainers
        dist.all_gather_object(everyone, (dp_rank, [list(map(int, p)) for p in prompts]), group=self.trainers)
        replicas: dict[int, list[list[int]]] = {}
        for rank, (dp, theirs) in enumerate(everyone):
            if replicas.setdefault(dp, theirs) != theirs:
                raise ValueError(f"DisaggregatedRollout.generate: trainer rank {rank} passed prompts that differ "
                                 f"from its data-parallel replica {dp}'s (its model-parallel peers must agree)")
        order = [(dp, i) for dp in sorted(replicas) for i in range(len(replicas[dp]))]
        samples = None
        if self.rank == SOURCE_RANK:
            self._channel_bcast(("generate", [replicas[dp][i] for dp, i in order], sampling))
            samples = sorted((s for part in self._from_engines() for s in part), key=lambda s: s[0])
        samples = self._trainer_bcast(samples)
        batch = RolloutBatch()
        for item, response, logprobs, finish in samples:  # stable sort keeps each prompt's sample order
            dp, i = order[item]
            if dp == dp_rank:
                batch.prompt_index.append(i)
                batch.prompt_ids.append(replicas[dp][i])
                batch.response_ids.append(list(response))
                batch.logprobs.append(list(logprobs))
                batch.finish_reasons.append(finish)
        return batch

    def stop_engines(self) -> None:
        """Trainer ranks: ends the engines' :meth:`serve` loop (call once, from every trainer rank)."""
        self._require(False, "stop_engines")
        if self.rank == SOURCE_RANK:
            self._channel_bcast(("stop",))
