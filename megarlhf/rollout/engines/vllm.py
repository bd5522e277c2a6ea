"""The vLLM backend: a vLLM ``LLM`` living inside a training rank (SPMD, no server).

Layouts: ``tensor_parallel_size=1``, one engine per rank generating its own prompts, in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``); or ``tensor_parallel_size=world_size``, one engine over all ranks
through vLLM's ``external_launcher`` (every rank passes the same prompts). Building an in-process engine
is collective over the default process group; with ``EngineConfig.in_process=False`` (an engine rank of
the disaggregated placement) vLLM's engine core runs in a spawned child with a world of its own, and
weight buckets reach it as handles to shared memory. Construction reseeds the global RNGs inside vLLM;
the caller's RNG states are restored.

Generation adds one request per prompt to vLLM's engine and steps it, as ``LLM.generate`` does, with
outputs delivered as deltas, so that :meth:`VLLMEngine.abort` can stop between steps and keep what each
sample generated so far. Streamed samples (:mod:`megarlhf.rollout.engines.streaming`) are one-sample requests
stepped by :meth:`VLLMEngine.advance`; while any is in flight a generate, load, probe or sleep is refused.
Log-probs: vLLM reports ``raw_logprobs`` at temperature 0 or 1 and
``processed_logprobs`` (after temperature) otherwise, the contract's quantity in both cases.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import random
import threading
from typing import Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist

from megarlhf.core.dtypes import check_dtype_name
from megarlhf.rollout.engines import vllm_worker
from megarlhf.rollout.engines.api import ENGINES, EngineConfig, EngineHealth, EngineSpec, RolloutEngine, WeightBucket
from megarlhf.rollout.engines.routing import record_from_vllm
from megarlhf.rollout.engines.sampling import FINISH_REASONS, RolloutBatch, SamplingConfig, check_prompt_ids
from megarlhf.rollout.engines.shared_tensor import share
from megarlhf.rollout.engines.streaming import SampleOutput, SampleRequest

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds a rank-``rank`` adapter (vLLM pads with zeros)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank}: vLLM serves adapters of rank at most {VLLM_LORA_RANKS[-1]}")


def vllm_logprobs_mode(temperature: float) -> str:
    """vLLM's ``logprobs_mode`` that reports the contract's log-probs at the sampling ``temperature``."""
    return "raw_logprobs" if temperature in (0.0, 1.0) else "processed_logprobs"


def child_visible_devices(visible: str | None, device_index: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a child process that must see only this process's device
    ``device_index`` (an index among this process's ``visible`` devices; None: all of them)."""
    if not visible:
        return str(device_index)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if device_index >= len(ids):
        raise ValueError(f"rollout engine: cuda:{device_index} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    return ids[device_index]


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _cpu_thread_binding(tp_size: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for a TP engine on CPU: this machine's cores split evenly per TP rank."""
    cores = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cores) // tp_size)
    chunks = [cores[(r * per_rank) % len(cores):(r * per_rank) % len(cores) + per_rank] for r in range(tp_size)]
    return "|".join(f"{c[0]}-{c[-1]}" if len(c) > 1 else str(c[0]) for c in chunks)


def _set_process_environment(config: EngineConfig, on_gpu: bool) -> None:
    """vLLM reads these at start-up: where its engine core runs and how its CPU threads are bound."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if config.in_process else "1"
    if not config.in_process:
        # a forked child would inherit this process's torch.distributed state; functions run in the
        # worker have to be pickled to reach the child
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if config.tensor_parallel_size > 1 and not on_gpu:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_thread_binding(config.tensor_parallel_size))
        _run_unique_shm_names()
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    if not on_gpu:
        _eager_token_ranks()


@contextlib.contextmanager
def _child_devices(config: EngineConfig, on_gpu: bool):
    """While an engine core starts in a child process (``in_process=False``) on a GPU: ``CUDA_VISIBLE_DEVICES``
    narrowed to this rank's device, which the child inherits (it uses its first visible GPU); restored after,
    so that this process and the engines built after it (a policy engine over all ranks beside an LLM judge's)
    still see every device."""
    if config.in_process or not on_gpu:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = child_visible_devices(before, torch.cuda.current_device())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _run_unique_shm_names() -> None:
    """vLLM-cpu names the shared memory of a TP engine's collectives after ``VLLM_DIST_IDENT``, which its CPU
    worker derives from the distributed init method: under the external launcher that is ``env://``, the same
    for every run, so two runs' TP engines on one machine at once collided (``create shm in SHMManager
    failed. errno: 17``). The names get the run's ``MASTER_PORT`` (the same on every rank of a run, another
    for each run on a machine)."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    original = shm.make_group_name
    if getattr(original, "megarlhf_run_unique", False):
        return

    def make_group_name(communicator) -> str:
        return f"{original(communicator)}-{os.environ.get('MASTER_PORT', '0')}"

    make_group_name.megarlhf_run_unique = True
    shm.make_group_name = staticmethod(make_group_name)


def _eager_token_ranks() -> None:
    """vLLM's sampler counts each log-prob's rank with ``batched_count_greater_than``, a ``torch.compile``d
    ``(x >= values).sum(-1)``. On CPU that compile (dynamo tracing, then inductor building C++) ran at the
    first request asking for log-probs and took 1.9 s of every engine's start-up; its fused kernel saves
    under a millisecond per decode step (a [batch, vocab] comparison). On CPU the sampler calls the same
    function uncompiled (vLLM keeps it as ``__wrapped__``); in this process only (an engine core in a child
    process compiles as usual)."""
    from vllm.v1.sample import sampler

    sampler.batched_count_greater_than = getattr(sampler.batched_count_greater_than, "__wrapped__",
                                                 sampler.batched_count_greater_than)


def _llm_arguments(hf_dir: str, config: EngineConfig, on_gpu: bool) -> dict:
    kwargs = dict(model=hf_dir, dtype=config.dtype, seed=config.seed, enforce_eager=config.enforce_eager,
                  max_model_len=config.max_model_len, kv_cache_memory_bytes=config.kv_cache_bytes,
                  enable_prefix_caching=True, logprobs_mode=vllm_logprobs_mode(config.temperature),
                  tensor_parallel_size=config.tensor_parallel_size, enable_sleep_mode=on_gpu,
                  # A prompt whose prefill is split over scheduler steps makes vLLM rewind the seeded
                  # request's generator offset, which CPU generators cannot do: on CPU prompts go whole.
                  enable_chunked_prefill=on_gpu,
                  use_tqdm_on_load=False,  # a progress bar per weight reload; the run has its own progress
                  # prompts arrive as token ids, responses leave as token ids (detokenize=False) and the
                  # tokenizer's end of sequence is among every request's stop ids: vLLM's own tokenizer
                  # (and its chat-template renderer) would only cost start-up (1.2 s on SmolLM2)
                  skip_tokenizer_init=True)
    if config.tensor_parallel_size > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if config.lora_rank:  # one adapter slot: the policy's current adapter (megarlhf.rollout.sync.adapters)
        if not config.lora_modules:
            raise ValueError("EngineConfig.lora_rank > 0 needs lora_modules (the projections adapted)")
        # Only the adapted projections get LoRA layers: an LM head with LoRA breaks vLLM's prompt log-probs
        # (per-sequence adapter indices applied to per-token rows: vLLM issues 29955 and 51594).
        kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(config.lora_rank), max_loras=1,
                      max_cpu_loras=1, lora_target_modules=list(config.lora_modules))
    if config.routing_layers:  # vLLM's V2 model runner (Triton, a GPU) returns them; its CPU runner cannot
        if not on_gpu:
            raise ValueError("routing replay r3 with rollout.backend='vllm' needs vLLM's routed-experts capture, "
                             "which runs on a GPU only; on CPU use rollout.backend='hf', which records routing")
        kwargs["enable_return_routed_experts"] = True
    return kwargs


def _append(kept: list, sample) -> None:
    """One step's new tokens of a vLLM sample (DELTA output) onto ``kept`` = [token ids, log-probs, finish
    reason, routed experts]."""
    kept[0] += sample.token_ids
    kept[1] += [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]
    if sample.finish_reason is not None:
        kept[2], kept[3] = sample.finish_reason, getattr(sample, "routed_experts", None)


class _NoTokenizerNotices(logging.Filter):
    """Drops vLLM's two notices about the tokenizer an engine is built without (``skip_tokenizer_init``:
    :func:`_llm_arguments`): its chat-template warm-up failing (with a traceback) and "Using None for EOS
    token id" (every request carries the tokenizer's end of sequence among its stop ids)."""

    LOGGER = "vllm.renderers.base"
    MESSAGES = ("Chat template warmup failed", "Using None for EOS token id because tokenizer is not initialized")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.MESSAGES

    @classmethod
    def install(cls) -> None:
        logger = logging.getLogger(cls.LOGGER)
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls())


class VLLMEngine(RolloutEngine):
    """One vLLM engine for this rank (or, with TP > 1, this rank's part of a shared engine)."""

    def __init__(self, hf_dir: str, config: EngineConfig, device: torch.device | None = None):
        rank, world = _world()
        tp = config.tensor_parallel_size
        if tp not in (1, world):
            raise ValueError(f"EngineConfig.tensor_parallel_size={tp}: must be 1 (one engine per rank) or the "
                             f"world size {world} (one engine over all ranks)")
        if not os.path.isfile(os.path.join(hf_dir, "config.json")):
            raise FileNotFoundError(f"rollout engine: {hf_dir} is not an HF model directory (no config.json)")
        check_dtype_name(config.dtype, "EngineConfig.dtype")
        self.config, self.rank = config, rank
        self.on_gpu = self.sleep_supported = torch.cuda.is_available()
        _set_process_environment(config, self.on_gpu)
        kwargs = _llm_arguments(hf_dir, config, self.on_gpu)
        self.lora_request = None  # the adapter every generation uses; None: the base weights
        self._abort, self._requests = threading.Event(), itertools.count()
        self._streamed: dict[str, tuple[SampleRequest, list]] = {}  # request id -> (request, what came so far)
        rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        from vllm import LLM

        _NoTokenizerNotices.install()

        # the engine's first load, reported for calibration's bitwise check (an unsharded engine in this process)
        reported = config.in_process and tp == 1
        with vllm_worker.first_load_reported() if reported else contextlib.nullcontext(), \
                _child_devices(config, self.on_gpu):
            self.llm = LLM(**kwargs)
        self._first_load = self.run_in_worker(vllm_worker.take_first_load_report) if reported else None
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()

    # ---- generation ---------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        sampling.validate(len(prompts))
        check_prompt_ids(prompts, self.vocab_size)
        self._idle("generate")
        self._abort.clear()
        ids = [self._add(prompt, sampling, sampling.n, sampling.max_new_tokens, sampling.prompt_seed(i))
               for i, prompt in enumerate(prompts)]
        samples = self._run(ids)
        return self._batch(prompts, sampling.n, [samples[request] for request in ids])

    def _add(self, prompt, sampling: SamplingConfig, n: int, max_tokens: int, seed: int | None) -> str:
        """Adds one request for ``n`` samples of ``prompt`` (token ids, log-probs, deltas); returns its id."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(n=n, temperature=sampling.temperature, max_tokens=max_tokens,
                                stop_token_ids=list(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
                                seed=seed, logprobs=0, detokenize=False, output_kind=RequestOutputKind.DELTA)
        request = f"megarlhf-{next(self._requests)}"
        self.llm.llm_engine.add_request(request, TokensPrompt(prompt_token_ids=list(map(int, prompt))), params,
                                        lora_request=self.lora_request)
        return request

    # ---- streaming (megarlhf.rollout.engines.streaming) -----------------------------------------------
    def submit(self, requests: list[SampleRequest], sampling: SamplingConfig) -> None:
        check_prompt_ids([r.prompt_ids for r in requests], self.vocab_size, self.config.max_model_len,
                         "streamed sample (its index in the call)")
        if not self._streamed:
            self._abort.clear()
        for r in requests:  # [token ids, log-probs, finish reason, routed experts] so far
            self._streamed[self._add(r.prompt_ids, sampling, 1, r.max_new_tokens, r.seed)] = r, [[], [], "abort", None]

    def advance(self) -> list[SampleOutput]:
        """Steps the engine until a streamed sample finished (every request in flight is one of them), or
        :meth:`abort` was called (then: what finished, perhaps nothing; :meth:`interrupt` takes the rest)."""
        engine, done = self.llm.llm_engine, []
        while self._streamed and not done and engine.has_unfinished_requests() and not self._abort.is_set():
            for output in engine.step():
                if output.request_id not in self._streamed:
                    raise RuntimeError(f"VLLMEngine.advance: vLLM stepped {output.request_id}, not a streamed sample")
                _, kept = self._streamed[output.request_id]
                for sample in output.outputs:
                    _append(kept, sample)
                if output.finished:
                    done.append(output.request_id)
        if self._streamed and not done and not self._abort.is_set():
            raise RuntimeError(f"VLLMEngine.advance: vLLM has no request left, but {len(self._streamed)} streamed "
                               "samples never finished")
        return [self._output(*entry) for entry in [self._streamed.pop(request) for request in done]]

    def interrupt(self) -> list[SampleOutput]:
        """Aborts every streamed request; each comes back with the tokens read from the engine so far (an engine
        core in its own process may have generated more, unread: those are dropped with the request)."""
        self.llm.llm_engine.abort_request(list(self._streamed))
        streamed, self._streamed = self._streamed, {}
        return [self._output(request, kept) for request, kept in streamed.values()]

    def in_flight(self) -> int:
        return len(self._streamed)

    def _output(self, request: SampleRequest, kept: list) -> SampleOutput:
        ids, logprobs, finish, routed = kept
        if finish not in FINISH_REASONS:
            raise RuntimeError(f"streamed sample {request.key!r}: vLLM finished it with {finish!r}")
        record = self._record(routed, len(request.prompt_ids) + len(ids))
        return SampleOutput(request.key, [int(t) for t in ids], logprobs, finish, record)

    def _record(self, routed, length: int):
        """A sample of ``length`` tokens: its routing record (replay r3); None unless the engine records it."""
        if not self.config.routing_layers:
            return None
        model_config = self.llm.llm_engine.model_config
        return record_from_vllm(routed, self.config.routing_layers, length, model_config.get_num_experts_per_tok(),
                                model_config.get_num_experts())

    def _run(self, ids: list[str]) -> dict[str, dict[int, list]]:
        """Steps the engine until every request finished or :meth:`abort` was called; per request and
        sample: [token ids, log-probs, finish reason, routed experts]."""
        engine, samples = self.llm.llm_engine, {request: {} for request in ids}
        while engine.has_unfinished_requests():
            if self._abort.is_set():
                engine.abort_request(ids)
                break
            for output in engine.step():
                for sample in output.outputs:
                    _append(samples[output.request_id].setdefault(sample.index, [[], [], "abort", None]), sample)
        return samples

    def _batch(self, prompts: list[list[int]], n: int, samples: list[dict[int, list]]) -> RolloutBatch:
        batch = RolloutBatch()
        for i, per_sample in enumerate(samples):
            for j in range(n):
                ids, logprobs, finish, routed = per_sample.get(j, [[], [], "abort", None])
                if finish not in FINISH_REASONS:
                    raise RuntimeError(f"rollout prompt {i}: vLLM finished a sample with {finish!r}")
                batch.prompt_index.append(i)
                batch.prompt_ids.append(list(map(int, prompts[i])))
                batch.response_ids.append([int(t) for t in ids])
                batch.logprobs.append(logprobs)
                batch.finish_reasons.append(finish)
                if self.config.routing_layers:
                    batch.routed_experts.append(self._record(routed, len(prompts[i]) + len(ids)))
        return batch

    def abort(self) -> None:
        """Stops :meth:`generate` before its next step (the engine steps in the generating thread, so the
        requests are aborted there). A tensor-parallel engine's ranks step together: it cannot abort one."""
        if self.config.tensor_parallel_size > 1:
            raise RuntimeError("VLLMEngine.abort: a tensor-parallel engine's ranks step in lock-step; abort needs "
                               "rollout.tensor_parallel_size=1")
        self._abort.set()

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._idle("prompt_logprobs")  # LLM.generate steps until every request is done, streamed ones too
        check_prompt_ids(sequences, self.vocab_size, self.config.max_model_len, "sequence to score")
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(map(int, s))) for s in sequences], params,
                                    use_tqdm=False, lora_request=self.lora_request)
        return [[step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], seq[1:])]
                for out, seq in zip(outputs, sequences)]

    # ---- weights ------------------------------------------------------------------------------------
    def run_in_worker(self, fn: Callable):
        """``fn(worker)`` on this rank's vLLM worker (this process, or the engine core's child process)."""
        return self.llm.collective_rpc(fn)[0]

    @property
    def _sharded(self) -> bool:
        """A TP > 1 engine holds shards: it reports what its loader received instead of its parameters."""
        return self.config.tensor_parallel_size > 1

    def fused_parameters(self) -> dict[str, list[str]]:
        return {} if self._sharded else self.run_in_worker(vllm_worker.layout)[0]

    def placement(self, hf_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, int]]:
        from megarlhf.rollout.engines.weights import fused_placement

        if self._sharded:
            return {}
        fused, experts = self.run_in_worker(vllm_worker.layout)
        return {**fused_placement(hf_shapes, fused), **experts}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """One ``reload_weights`` call streaming ``weights``, then the prefix cache is dropped."""
        self._idle("load_weights")
        self._first_load = None  # no longer what the engine holds
        report = self.run_in_worker(functools.partial(vllm_worker.reload_and_report, weights=weights,
                                                      sharded=self._sharded))
        self.llm.reset_prefix_cache()
        return report

    def begin_load(self) -> None:
        self._idle("begin_load")
        self._first_load = None
        self.run_in_worker(vllm_worker.begin_session)

    def load_bucket(self, bucket: WeightBucket) -> None:
        if self.config.in_process:
            self.run_in_worker(functools.partial(vllm_worker.load_tensors, tensors=bucket.tensors()))
        else:
            self.run_in_worker(functools.partial(vllm_worker.load_shared, meta=bucket.meta,
                                                 handle=share(bucket.payload)))

    def finish_load(self) -> dict:
        report = self.run_in_worker(vllm_worker.finish_session)
        self.llm.reset_prefix_cache()
        return report

    def load_adapter(self, directory: str) -> dict:
        """Loads the adapter under a new id (no cached adapter or prefix-cache entry of the previous one is
        reused; the previous one is evicted from the engine's one slot)."""
        from vllm.lora.request import LoRARequest

        self._idle("load_adapter")
        if not self.config.lora_rank:
            raise RuntimeError("rollout engine: load_adapter needs an engine built with lora_rank > 0")
        number = self.lora_request.lora_int_id + 1 if self.lora_request is not None else 1
        request = LoRARequest(f"policy-{number}", number, str(directory))
        self.lora_request = None  # until the new one is in: a failed load leaves no adapter to generate with
        self.llm.llm_engine.add_lora(request)
        self.lora_request = request
        self.llm.reset_prefix_cache()
        report = self.run_in_worker(functools.partial(vllm_worker.lora_slot_report, lora_id=number))
        held = self.llm.llm_engine.list_loras()
        if held != {number}:
            report["problems"].append(f"the engine holds LoRA adapters {sorted(held)}, not just the new {number}")
        return report

    def checkpoint_report(self) -> dict:
        """The report of the engine's own load of its checkpoint: its first load's, when nothing was loaded
        since (once), else a reload of the checkpoint from disk through vLLM's own loader (on CPU vLLM packs
        linear weights away after loading: they can only be fingerprinted while a load processes them)."""
        self._idle("checkpoint_report")
        if self._first_load is not None:
            report, self._first_load = self._first_load, None
            return report
        report = self.run_in_worker(functools.partial(vllm_worker.reload_checkpoint_and_report,
                                                      sharded=self._sharded))
        self.llm.reset_prefix_cache()
        return report

    # ---- memory and liveness ------------------------------------------------------------------------
    def sleep(self) -> None:
        """Level 1: weights offloaded to the host, KV cache discarded (GPU only; vLLM-cpu has no sleep mode)."""
        self._idle("sleep")
        if self.sleep_supported:
            self.llm.sleep(level=1)

    def wake_up(self, tags: list[str]) -> None:
        super().wake_up(tags)
        if self.sleep_supported:
            self.llm.wake_up(tags=list(tags))

    def health(self) -> EngineHealth:
        """An engine core in a child process (``in_process=False``) can die on its own: its process is
        checked, and vLLM's own mark of a dead engine."""
        resources = getattr(self.llm.llm_engine.engine_core, "resources", None)
        if resources is None:  # in this process: as alive as the caller
            return EngineHealth(True)
        dead = [proc for proc in self.engine_processes() if not proc.is_alive()]
        if dead or resources.engine_dead:
            codes = ", ".join(f"{proc.name} exit code {proc.exitcode}" for proc in dead)
            return EngineHealth(False, f"vLLM's engine core process died ({codes or 'marked dead by vLLM'})")
        return EngineHealth(True)

    def kill(self) -> None:
        processes = self.engine_processes()
        for proc in processes:
            proc.kill()
        for proc in processes:  # gone before a replacement asks for their memory
            proc.join(timeout=30)

    def close(self) -> None:
        """Stops an engine core in child processes (its sockets and threads too); one in this process goes
        with the engine."""
        if getattr(self.llm.llm_engine.engine_core, "resources", None) is not None:
            self.llm.llm_engine.engine_core.shutdown(timeout=10)

    def engine_processes(self) -> list:
        """The processes of an engine core that runs out of this process (none in process)."""
        resources = getattr(self.llm.llm_engine.engine_core, "resources", None)
        manager = getattr(resources, "engine_manager", None)
        return list(getattr(manager, "processes", []))


ENGINES.register("vllm")(EngineSpec(build=VLLMEngine, tensor_parallel=True, adapter_rank=vllm_lora_rank))
