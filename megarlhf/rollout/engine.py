"""The rollout engine: a vLLM ``LLM`` living inside a training rank (SPMD, no server).

:class:`RolloutEngine` owns one in-process vLLM engine and exposes what the RL loop needs from it:
generation from token ids (n samples per prompt, seeded) returning response ids, the log-probs of the
sampled tokens and finish reasons; prompt log-probs (the weight-sync probe); in-place weight loading
from an iterator of HF-named tensors; and sleep / wake-up of weights and KV cache where vLLM supports it
(GPU only; on CPU vLLM has no sleep mode and these are no-ops).

Layouts (docs/PLATFORM.md, "vLLM inside torchrun ranks"):

* ``tensor_parallel_size=1`` (the default): one engine per rank, each generating its own share of the
  prompts. Plain ``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so the engine runs in this process.
* ``tensor_parallel_size=world_size``: one engine spread over all ranks through vLLM's
  ``external_launcher`` backend; every rank must pass the SAME prompts and gets the same outputs.

Engine construction is collective over the default process group: every rank must build (and later
drop) its engine together. torch.distributed must be initialised first when there is more than one
rank. Construction reseeds the global RNGs inside vLLM; this class restores the caller's RNG states.

Hand-written because it is megarlhf's contract with vLLM (request layout, seeding, result shape, the
reload path that works on CPU); vLLM itself does all generation and weight loading.
"""
from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist

from megarlhf.core.dtypes import check_dtype_name, torch_dtype
from megarlhf.rollout.batch import FINISH_REASONS, RolloutBatch, check_prompt_ids
from megarlhf.rollout.config import RolloutConfig, SamplingConfig, vllm_logprobs_mode, vllm_lora_rank
from megarlhf.rollout.engine_weights import (ExpectedReloadNotices, ProcessingCapture, adapter_report, arrival_report,
                                             expert_placement, fused_parameters, parameter_report, repack_experts,
                                             reprocess_tied, tied_modules)
from megarlhf.rollout.fingerprint import fingerprint
from megarlhf.rollout.hf_engine import HFRolloutEngine
from megarlhf.rollout.routing import record_from_vllm

__all__ = ["EngineConfig", "RolloutEngine", "make_engine"]


@dataclass(frozen=True)
class EngineConfig:
    """How to build one rollout engine; made from the run config by :meth:`from_rollout` only (no defaults
    of its own: ``rollout`` and the run hold them)."""

    backend: str  # "vllm" or "hf" (RolloutConfig.backend)
    tensor_parallel_size: int
    dtype: str  # a megarlhf.core.dtypes name
    seed: int
    enforce_eager: bool
    max_model_len: int
    kv_cache_bytes: int
    # "raw_logprobs" (temperature 1) or "processed_logprobs" (after temperature): the sampling/scoring
    # contract of megarlhf.rollout.config
    logprobs_mode: str
    num_threads: int | None  # torch threads for this rank; vLLM forbids changing them later
    # False: vLLM's engine core runs in a child process (spawned) with its own one-rank torch.distributed
    # world, so that building it is not collective over this job's default group (disaggregated mode).
    in_process: bool
    # > 0: vLLM serves one LoRA adapter of at most this rank (adapter-only sync); 0: no LoRA in the engine
    max_lora_rank: int = 0
    # the HF projections the adapter may touch (vLLM's lora_target_modules): only they get LoRA kernels
    lora_modules: tuple[str, ...] = ()
    # the HF layer indices of an MoE model's MoE layers when the engine records routing (routing replay R3;
    # megarlhf.rollout.routing), else ()
    routing_layers: tuple[int, ...] = ()

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig, *, model_dtype: str, seed: int, max_prompt_length: int,
                     in_process: bool = True, lora_rank: int = 0, lora_modules: tuple[str, ...] = (),
                     routing_layers: tuple[int, ...] = ()) -> "EngineConfig":
        return cls(backend=rollout.backend, tensor_parallel_size=rollout.tensor_parallel_size,
                   dtype=rollout.engine_dtype(model_dtype), seed=seed, enforce_eager=rollout.enforce_eager,
                   max_model_len=max_prompt_length + rollout.response_budget,
                   kv_cache_bytes=rollout.kv_cache_mb * 2**20, logprobs_mode=vllm_logprobs_mode(rollout),
                   num_threads=torch.get_num_threads(), in_process=in_process,
                   max_lora_rank=vllm_lora_rank(lora_rank) if lora_rank else 0, lora_modules=tuple(lora_modules),
                   routing_layers=tuple(routing_layers))


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


class RolloutEngine:
    """One vLLM engine for this rank (or, with TP > 1, this rank's part of a shared engine)."""

    def __init__(self, hf_dir: str, config: EngineConfig):
        rank, world = _world()
        tp = config.tensor_parallel_size
        if tp not in (1, world):
            raise ValueError(f"EngineConfig.tensor_parallel_size={tp}: must be 1 (one engine per rank) or the "
                             f"world size {world} (one engine over all ranks)")
        if not os.path.isfile(os.path.join(hf_dir, "config.json")):
            raise FileNotFoundError(f"rollout engine: {hf_dir} is not an HF model directory (no config.json)")
        self.config, self.rank = config, rank
        self.on_gpu = torch.cuda.is_available()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if config.in_process else "1"
        if not config.in_process:
            # a forked child would inherit this process's torch.distributed state; functions for
            # run_in_worker have to be pickled to reach the child
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
            if self.on_gpu:  # the engine core uses its first visible GPU: make it this rank's
                os.environ["CUDA_VISIBLE_DEVICES"] = child_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"),
                                                                           torch.cuda.current_device())
        if tp > 1 and not self.on_gpu:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_thread_binding(tp))
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        check_dtype_name(config.dtype, "EngineConfig.dtype")
        kwargs = dict(model=hf_dir, dtype=config.dtype, seed=config.seed,
                      enforce_eager=config.enforce_eager, max_model_len=config.max_model_len,
                      kv_cache_memory_bytes=config.kv_cache_bytes, enable_prefix_caching=True,
                      logprobs_mode=config.logprobs_mode,
                      tensor_parallel_size=tp, enable_sleep_mode=self.on_gpu,
                      # A prompt whose prefill is split over scheduler steps makes vLLM rewind the
                      # seeded request's generator offset, which CPU generators cannot do ("CPU
                      # Generator does not use offset"): on CPU prompts are scheduled whole.
                      enable_chunked_prefill=self.on_gpu)
        if tp > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if config.max_lora_rank:  # one adapter slot: the policy's current adapter (megarlhf.rollout.adapter_sync)
            if not config.lora_modules:
                raise ValueError("EngineConfig.max_lora_rank > 0 needs lora_modules (the projections adapted)")
            # Only the adapted projections get LoRA layers: the others would run LoRA kernels on zeros, and an
            # LM head with LoRA breaks vLLM's prompt log-probs (per-sequence adapter indices applied to
            # per-token rows: vLLM issues 29955 and 51594), which the sync's probe reads.
            kwargs.update(enable_lora=True, max_lora_rank=config.max_lora_rank, max_loras=1, max_cpu_loras=1,
                          lora_target_modules=list(config.lora_modules))
        if config.routing_layers:  # vLLM's V2 model runner (Triton, a GPU) returns them; its CPU runner cannot
            if not self.on_gpu:
                raise ValueError("routing replay r3 with rollout.backend='vllm' needs vLLM's routed-experts capture, "
                                 "which runs on a GPU only; on CPU use rollout.backend='hf', which records routing")
            kwargs["enable_return_routed_experts"] = True
        self.lora_request = None  # the adapter every generation uses; None: the base weights
        rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        from vllm import LLM

        self.llm = LLM(**kwargs)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()

    # ---- generation ---------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        """Samples ``sampling.n`` responses for each prompt (token ids). With TP > 1 every rank must pass
        the same prompts."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sampling.validate(len(prompts))
        check_prompt_ids(prompts, self.vocab_size)
        params = []
        for i in range(len(prompts)):
            seed = sampling.prompt_seed(i)
            params.append(SamplingParams(
                n=sampling.n, temperature=sampling.temperature,
                max_tokens=sampling.max_new_tokens, stop_token_ids=list(sampling.stop_token_ids),
                ignore_eos=sampling.ignore_eos, seed=seed, logprobs=0, detokenize=False))
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts], params,
                                    use_tqdm=False, lora_request=self.lora_request)
        batch = RolloutBatch()
        for i, out in enumerate(outputs):
            for sample in sorted(out.outputs, key=lambda s: s.index):
                ids = list(sample.token_ids)
                if sample.finish_reason not in FINISH_REASONS:
                    raise RuntimeError(f"rollout prompt {i}: vLLM finished a sample with {sample.finish_reason!r}")
                batch.prompt_index.append(i)
                batch.prompt_ids.append(list(map(int, prompts[i])))
                batch.response_ids.append(ids)
                batch.logprobs.append([step[tok].logprob for step, tok in zip(sample.logprobs, ids)])
                if self.config.routing_layers:
                    model_config = self.llm.llm_engine.model_config
                    batch.routed_experts.append(record_from_vllm(
                        sample.routed_experts, self.config.routing_layers, len(prompts[i]) + len(ids),
                        model_config.get_num_experts_per_tok(), model_config.get_num_experts()))
                batch.finish_reasons.append(sample.finish_reason)
        return batch

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probs of tokens 1..L-1 of each sequence given its prefix (teacher forcing in vLLM)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_prompt_ids(sequences, self.vocab_size)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(map(int, s))) for s in sequences], params,
                                    use_tqdm=False, lora_request=self.lora_request)
        return [[step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], seq[1:])]
                for out, seq in zip(outputs, sequences)]

    # ---- weights and memory -------------------------------------------------------------------------
    def run_in_worker(self, fn: Callable):
        """Runs ``fn(worker)`` on this rank's vLLM worker (in this process) and returns its result."""
        return self.llm.collective_rpc(fn)[0]

    def fused_parameters(self) -> dict[str, list[str]]:
        """How the engine's parameters fuse HF tensors (:func:`~megarlhf.rollout.engine_weights.fused_parameters`),
        for the trainer's prediction of the engine's fingerprints. A TP > 1 engine holds shards and reports
        what its loader received instead (:meth:`load_weights`): nothing fused."""
        if self.config.tensor_parallel_size > 1:
            return {}
        return self.run_in_worker(lambda worker: fused_parameters(worker.model_runner.model))

    def placement(self, hf_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, int]]:
        """Each HF tensor's place in the engine's parameters (:func:`~megarlhf.rollout.weight_sync.engine_placement`
        over :meth:`fused_parameters`, and the stacked experts of an MoE model: :func:`expert_placement`)."""
        from megarlhf.rollout.weight_sync import engine_placement

        experts = {} if self.config.tensor_parallel_size > 1 else \
            self.run_in_worker(lambda worker: expert_placement(worker.model_runner.model))
        return {**engine_placement(hf_shapes, self.fused_parameters()), **experts}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """Reloads the engine's weights in place from ``(hf_name, full tensor)`` pairs, then drops the
        prefix cache (its KV entries were computed with the old weights); returns the fingerprints of the
        parameters the engine now computes with (:func:`~megarlhf.rollout.engine_weights.parameter_report`).

        Uses the worker's ``reload_weights``: on CPU vLLM repacks linear weights after loading, so writing
        parameters directly has no effect. A TP > 1 engine (each rank a shard of every fused parameter)
        reports the fingerprints of the full tensors its loader received instead.
        """
        sharded = self.config.tensor_parallel_size > 1
        report = self.run_in_worker(lambda worker: reload_and_report(worker, weights, sharded))
        self.llm.reset_prefix_cache()
        return report

    def load_adapter(self, directory: str) -> dict:
        """Makes the PEFT adapter in ``directory`` the one every generation uses (under a new adapter id, so
        that no cached adapter or prefix-cache entry of the previous one is reused; the previous one is
        evicted from the engine's one slot), and returns the fingerprints of the adapter slot the LoRA
        kernels now read (:func:`~megarlhf.rollout.engine_weights.adapter_report`)."""
        from vllm.lora.request import LoRARequest

        if not self.config.max_lora_rank:
            raise RuntimeError("rollout engine: load_adapter needs an engine built with max_lora_rank > 0")
        number = self.lora_request.lora_int_id + 1 if self.lora_request is not None else 1
        request = LoRARequest(f"policy-{number}", number, str(directory))
        self.lora_request = None  # until the new one is in: a failed load leaves no adapter to generate with
        self.llm.llm_engine.add_lora(request)  # one adapter slot: the previous adapter is evicted
        self.lora_request = request
        self.llm.reset_prefix_cache()
        report = self.run_in_worker(functools.partial(_adapter_report, lora_id=number))
        held = self.llm.llm_engine.list_loras()
        if held != {number}:
            report["problems"].append(f"the engine holds LoRA adapters {sorted(held)}, not just the new {number}")
        return report

    def checkpoint_report(self) -> dict:
        """Reloads the checkpoint the engine was built from, from disk through vLLM's own loader, and
        returns the :meth:`load_weights` report of it: the gates' calibration compares it bit for bit with
        the trainer's conversion of the same checkpoint (on CPU vLLM packs linear weights away after
        loading, so they can only be fingerprinted while a load processes them)."""
        sharded = self.config.tensor_parallel_size > 1
        report = self.run_in_worker(functools.partial(reload_checkpoint_and_report, sharded=sharded))
        self.llm.reset_prefix_cache()
        return report

    @property
    def sleep_supported(self) -> bool:
        """vLLM's sleep mode exists on GPU only; on CPU sleep and wake_up do nothing."""
        return self.on_gpu

    def sleep(self) -> None:
        """Frees weights and KV cache memory (level 1: weights are offloaded to CPU, cache discarded)."""
        if self.sleep_supported:
            self.llm.sleep(level=1)

    def wake_up(self, tags: list[str]) -> None:
        """Re-allocates ``tags`` ("weights", "kv_cache")."""
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"RolloutEngine.wake_up: unknown tags {sorted(unknown)}")
        if self.sleep_supported:
            self.llm.wake_up(tags=list(tags))


def _adapter_report(worker, lora_id: int) -> dict:
    return adapter_report(worker.model_runner.lora_manager._adapter_manager, lora_id)


def reload_and_report(worker, weights: Iterable[tuple[str, torch.Tensor]], sharded: bool) -> dict:
    """On a vLLM worker: reloads the model's weights in place from ``weights`` and returns the fingerprints
    of the parameters it now computes with (of the tensors received, for a sharded engine)."""
    model = worker.model_runner.model
    tied, arrived = tied_modules(model), {}

    def arriving():
        for name, tensor in weights:
            if sharded:
                arrived[name] = fingerprint(tensor)
            yield name, tensor

    with ProcessingCapture(model) as capture, ExpectedReloadNotices(model):
        worker.reload_weights(weights_iterator=arriving())
        reprocess_tied(tied)
    report = arrival_report(arrived, capture) if sharded else \
        parameter_report(model, capture, worker.model_runner.model_config.dtype)
    repack_experts(model)  # after the report: see engine_weights.repack_experts
    return report


def reload_checkpoint_and_report(worker, sharded: bool) -> dict:
    """:func:`reload_and_report` of the engine's own checkpoint, read from disk by vLLM's model loader.

    Floating tensors are cast to the engine's dtype first, as its first load did by loading into
    parameters of that dtype: a parameter that processing after that load widened to float32 (vLLM's AMX
    path upcasts the bias of small GEMMs) would otherwise take a float32 checkpoint's values unrounded,
    and the engine would compute with other values than it did, and than the trainer does, until the next
    sync."""
    from vllm.model_executor.model_loader import get_model_loader

    runner = worker.model_runner
    dtype = runner.vllm_config.model_config.dtype
    loader = get_model_loader(runner.vllm_config.load_config)
    weights = ((name, tensor.to(dtype) if tensor.is_floating_point() else tensor)
               for name, tensor in loader.get_all_weights(runner.vllm_config.model_config, runner.get_model()))
    return reload_and_report(worker, weights, sharded)


def make_engine(hf_dir: str, config: EngineConfig, device: torch.device):
    """The rollout engine ``config.backend`` names: vLLM's (:class:`RolloutEngine`) or plain transformers'
    (:class:`megarlhf.rollout.hf_engine.HFRolloutEngine`, one engine per rank, no vLLM needed); both
    keep the same contract (generate with log-probs, prompt log-probs, load weights, sleep / wake up)."""
    if config.backend == "hf":
        if config.tensor_parallel_size != 1:
            raise ValueError(f"rollout.backend='hf' runs one engine per rank: rollout.tensor_parallel_size must "
                             f"be 1, got {config.tensor_parallel_size}")
        return HFRolloutEngine(hf_dir, dtype=torch_dtype(config.dtype), device=device, seed=config.seed,
                               max_model_len=config.max_model_len, routing_layers=config.routing_layers)
    if config.backend != "vllm":
        raise ValueError(f"unknown rollout backend {config.backend!r} (vllm, hf)")
    return RolloutEngine(hf_dir, config)

