"""The rollout-engine contract: what every backend implements, how it is built, and what it declares.

A backend is one file with a :class:`RolloutEngine` subclass and one :data:`ENGINES` entry (an
:class:`EngineSpec`) under the name ``rollout.backend`` selects. The rollout phase, the weight syncs and the
disaggregated transport use engines only through this contract; the run's checks read the entry's
declarations (tensor parallelism, adapter-only sync). Nothing else switches on a backend's name.

The contract, one engine per rank (or one rank's part of a tensor-parallel engine):

* **generate** ``n`` samples per prompt from token ids, each with the log-prob of every sampled token as
  the sampling/scoring contract defines it (:mod:`megarlhf.config.rollout`): ``log softmax(logits / T)``
  over the whole vocabulary, ``T`` the sampling temperature (1 when greedy). Seeds are per sample
  (:class:`~megarlhf.rollout.engines.sampling.SamplingConfig`), so a sample never depends on its batch.
* **stream**: :meth:`RolloutEngine.submit` single samples (each with its own seed and token limit) to the
  generation under way, :meth:`RolloutEngine.advance` until some finished, :meth:`RolloutEngine.interrupt`
  the rest with their tokens so far (:mod:`megarlhf.rollout.engines.streaming`); a backend that only
  generates in batches gets :class:`~megarlhf.rollout.engines.streaming.BatchStream`. While any is in flight
  nothing else may use the engine (no batch generation, load, probe or sleep: interrupt first).
* **prompt_logprobs**: teacher-forced log-probs at temperature 1 (the weight sync's probe).
* **load weights**: full HF-named tensors, streamed in :class:`WeightBucket`\\ s inside one load session
  (:meth:`begin_load`, :meth:`load_bucket`, :meth:`finish_load`), or adapter-only
  (:meth:`load_adapter`); MoE experts and fused projections land where :meth:`placement` says.
* **report fingerprints** of the parameters it computes with after a load
  (:mod:`megarlhf.rollout.engines.fingerprint`), and of its own load of the checkpoint
  (:meth:`checkpoint_report`), so the trainer verifies every sync bit for bit.
* **sleep / wake_up** of weights and KV cache, where the backend can free them.
* **abort**: from another thread, stops the generation in flight; its unfinished samples come back with
  finish reason ``"abort"`` and the tokens (and log-probs) generated so far.
* **health**: whether the engine can still serve (:class:`EngineHealth`); **kill** ends an engine that runs
  in processes of its own at once (one that stopped answering), so that it can be replaced.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from megarlhf.config.rollout import RolloutConfig
from megarlhf.core.registry import Registry
from megarlhf.rollout.engines.sampling import RolloutBatch, SamplingConfig
from megarlhf.rollout.engines.streaming import BatchStream, SampleOutput, SampleRequest

TAGS = ("weights", "kv_cache")  # what wake_up re-allocates


@dataclass(frozen=True)
class EngineConfig:
    """How to build one engine; made from the run config by :meth:`from_rollout` (no defaults of its own)."""

    backend: str  # a name in ENGINES (rollout.backend)
    tensor_parallel_size: int
    dtype: str  # a megarlhf.core.dtypes name
    seed: int
    enforce_eager: bool  # no compilation or graph capture: fast start, slower decoding
    max_model_len: int  # prompt + response tokens
    kv_cache_bytes: int
    temperature: float  # the rollout's sampling temperature: which log-probs a backend must report
    num_threads: int | None  # torch threads of this rank (set before the engine starts)
    # False: the engine must not join this job's process groups (an engine rank of the disaggregated
    # placement); a backend whose start-up is collective then runs in a child process
    in_process: bool
    lora_rank: int = 0  # > 0: the engine serves one LoRA adapter of this rank (adapter-only sync)
    lora_modules: tuple[str, ...] = ()  # the HF projections that adapter touches
    routing_layers: tuple[int, ...] = ()  # MoE layers whose routing each sample records (replay r3), else ()

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig, *, model_dtype: str, seed: int, max_prompt_length: int,
                     in_process: bool = True, lora_rank: int = 0, lora_modules: tuple[str, ...] = (),
                     routing_layers: tuple[int, ...] = ()) -> "EngineConfig":
        return cls(backend=rollout.backend, tensor_parallel_size=rollout.tensor_parallel_size,
                   dtype=rollout.engine_dtype(model_dtype), seed=seed, enforce_eager=rollout.enforce_eager,
                   max_model_len=max_prompt_length + rollout.response_budget,
                   kv_cache_bytes=rollout.kv_cache_mb * 2**20, temperature=rollout.temperature,
                   num_threads=torch.get_num_threads(), in_process=in_process, lora_rank=lora_rank,
                   lora_modules=tuple(lora_modules), routing_layers=tuple(routing_layers))


@dataclass(frozen=True)
class EngineHealth:
    ok: bool
    detail: str = ""  # what is wrong, when not ok


@dataclass
class WeightBucket:
    """Named tensors packed into one flat byte buffer: how weights travel (one broadcast per bucket, one
    handle to shared memory for an engine in another process). ``meta`` holds (name, dtype, shape, nbytes)."""

    meta: list[tuple[str, str, tuple[int, ...], int]]
    payload: torch.Tensor  # uint8, on the sender's (or the receiver's) device

    @classmethod
    def pack(cls, tensors: list[tuple[str, torch.Tensor]]) -> "WeightBucket":
        meta = [(name, str(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for name, t in tensors]
        payload = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for _, t in tensors])
        return cls(meta, payload)

    @property
    def nbytes(self) -> int:
        return sum(record[3] for record in self.meta)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The named tensors, as views of ``payload``."""
        out, offset = [], 0
        for name, dtype, shape, nbytes in self.meta:
            chunk = self.payload[offset:offset + nbytes]
            out.append((name, chunk.view(getattr(torch, dtype.removeprefix("torch."))).view(shape)))
            offset += nbytes
        return out


class RolloutEngine(abc.ABC):
    """The contract (module docstring). Reports are plain data: ``{"parameters": {name: [a, b]},
    "processed": {...}, "aliases": {...}, "problems": [...], "seconds": s}`` for weights
    (:func:`~megarlhf.rollout.engines.weights.parameter_report`), ``{"adapters": ..., "problems": ...,
    "seconds": ...}`` for adapters."""

    config: EngineConfig
    vocab_size: int
    sleep_supported: bool = False

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        """``sampling.n`` samples per prompt, prompt-major; with TP > 1 every rank passes the same prompts."""

    def submit(self, requests: list[SampleRequest], sampling: SamplingConfig) -> None:
        """Adds single samples to the streamed generation (``sampling``: temperature, stop tokens; its n, seeds and
        limit are the requests'). Until none is in flight only streaming calls may use the engine."""
        self._batch_stream().submit(requests, sampling)

    def advance(self) -> list[SampleOutput]:
        """Generates until at least one streamed sample finished (none in flight: returns at once); those."""
        return self._batch_stream().advance()

    def interrupt(self) -> list[SampleOutput]:
        """Stops every streamed sample in flight; returns each with its tokens so far (finish reason "abort")."""
        return self._batch_stream().interrupt()

    def in_flight(self) -> int:
        """How many streamed samples are submitted and not yet returned."""
        return self._batch_stream().in_flight()

    def _idle(self, what: str) -> None:
        """Refuses ``what`` while streamed samples are in flight (vLLM's engine core in a process of its own would
        step them under a load's half-replaced weights, a probe's requests, a sleep)."""
        if self.in_flight():
            raise RuntimeError(f"{type(self).__name__}.{what}: {self.in_flight()} streamed samples are in flight; "
                               "interrupt them first (and submit them again as prompt + tokens so far)")

    def _batch_stream(self) -> BatchStream:
        if getattr(self, "_stream", None) is None:
            self._stream = BatchStream(self)
        return self._stream

    @abc.abstractmethod
    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probs of tokens 1..L-1 of each sequence given its prefix (temperature 1)."""

    @abc.abstractmethod
    def placement(self, hf_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, int]]:
        """Each HF tensor's place in the engine, ``hf_name -> (parameter, element offset)``, for the HF
        tensors held inside a parameter of another name (fused projections, stacked experts)."""

    def fused_parameters(self) -> dict[str, list[str]]:
        """Engine parameters that fuse several HF projections, ``parameter -> [HF names]`` (none here)."""
        return {}

    @abc.abstractmethod
    def begin_load(self) -> None:
        """Starts a load session: the buckets that follow replace weights in place."""

    @abc.abstractmethod
    def load_bucket(self, bucket: WeightBucket) -> None:
        """Loads one bucket of full HF-named tensors (the bucket's memory may be reused once this returns)."""

    @abc.abstractmethod
    def finish_load(self) -> dict:
        """Ends the session (drops what the old weights computed, e.g. a prefix cache) and returns the
        fingerprint report of the parameters the engine now computes with."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """Loads ``(hf_name, full tensor)`` pairs in one session; returns :meth:`finish_load`'s report."""
        self.begin_load()
        for name, tensor in weights:
            self.load_bucket(WeightBucket.pack([(name, tensor)]))
        return self.finish_load()

    def load_adapter(self, directory: str) -> dict:
        """Makes the PEFT adapter in ``directory`` the one every generation uses; returns the fingerprint
        report of the adapter slots its kernels read. Only backends declaring ``adapter_rank`` have it."""
        raise NotImplementedError(f"{type(self).__name__} does not load adapters alone")

    @abc.abstractmethod
    def checkpoint_report(self) -> dict:
        """The fingerprint report of the engine's own load of the checkpoint it was built from."""

    def sleep(self) -> None:
        """Frees weights and KV cache memory where the backend can (``sleep_supported``)."""

    def wake_up(self, tags: list[str]) -> None:
        """Re-allocates ``tags`` (of :data:`TAGS`) after :meth:`sleep`."""
        unknown = set(tags) - set(TAGS)
        if unknown:
            raise ValueError(f"{type(self).__name__}.wake_up: unknown tags {sorted(unknown)}")

    @abc.abstractmethod
    def abort(self) -> None:
        """Stops the generation in flight (called from another thread; nothing in flight: no effect)."""

    def health(self) -> EngineHealth:
        return EngineHealth(True)

    def kill(self) -> None:
        """Kills the engine's own processes (its health then says so); an engine in this process has none."""

    def close(self) -> None:
        """Releases what the engine holds beyond its memory (processes, threads)."""


@dataclass(frozen=True)
class EngineSpec:
    """A registered backend: how to build it and what it supports. The run's checks read these declarations
    (:mod:`megarlhf.run.checks`); the rest of megarlhf uses only the :class:`RolloutEngine` it builds."""

    build: Callable[[str, EngineConfig, torch.device], RolloutEngine]  # (model dir, config, this rank's device)
    tensor_parallel: bool = False  # one engine over several ranks (rollout.tensor_parallel_size > 1)
    # adapter-only sync (rollout.weight_sync.lora='adapter'): the rank of the adapter slot the engine keeps for a
    # rank-r adapter (its kernels pad with zeros), raising past the largest it serves; None: not supported
    adapter_rank: Callable[[int], int] | None = None


ENGINES: Registry[EngineSpec] = Registry("rollout engine")


def build_engine(model_dir: str, config: EngineConfig, device: torch.device) -> RolloutEngine:
    """The engine ``config.backend`` names."""
    return ENGINES.get(config.backend).build(model_dir, config, device)
