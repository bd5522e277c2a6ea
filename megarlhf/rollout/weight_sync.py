"""Megatron -> vLLM weight sync, verified on every call.

:class:`WeightSync` streams the live sharded Megatron model into a running :class:`RolloutEngine`
without touching disk:

1. ``iter_hf_weights`` (the project's one Megatron -> HF mapping; TP all-gather and PP broadcast inside)
   yields full HF-named tensors; they are grouped into buckets of at most ``bucket_mb`` (a tensor larger
   than that travels alone), so at most one bucket of full tensors is alive at a time, never the model.
2. Each bucket is handed to vLLM's in-place ``reload_weights`` (one call for the whole stream), then the
   prefix cache is reset.
3. Checksums (CRC-32 of the raw bytes, plus dtype and shape) are taken on the trainer side as tensors
   leave ``iter_hf_weights`` and on the engine side as vLLM's loader takes them, inside the worker.
   vLLM fuses qkv / gate_up and repacks linear weights for oneDNN on CPU, so its parameters cannot be
   compared with HF tensors bit for bit; what it received can. Any missing, extra or altered tensor
   stops the run with a :class:`WeightSyncError` naming it.
4. A probe forward: the engine's prompt log-probs of fixed random sequences vs the trainer's own
   (:func:`megarlhf.rollout.logprobs.token_logprobs`) within ``probe_tolerance``; this catches what the
   checksums cannot (a loader that puts a received tensor in the wrong place).

The verdict is agreed over the default process group, so every rank raises together instead of one
rank leaving the others waiting in the next collective.

Hand-written because the bucketing, the two-sided checksums and the probe are megarlhf's own contract;
vLLM does the loading (``reload_weights``) and Megatron the gathering.
"""
from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarlhf.rollout.engine import RolloutEngine
from megarlhf.rollout.logprobs import token_logprobs
from model_providers.hf_checkpoint import iter_hf_weights


class WeightSyncError(RuntimeError):
    """The engine's weights are not the trainer's after a sync; the message names what differs."""


def tensor_checksum(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], int]:
    """(dtype, shape, CRC-32 of the bytes): any change of any bit of any element changes it."""
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
    return str(tensor.dtype), tuple(tensor.shape), zlib.crc32(memoryview(raw))


def compare_checksums(sent: dict[str, tuple], received: dict[str, tuple]) -> list[str]:
    """Human-readable differences between trainer-side and engine-side checksums (empty: identical)."""
    problems = [f"tensor {n} was sent but never reached the engine" for n in sent if n not in received]
    problems += [f"tensor {n} reached the engine but was not sent by the trainer" for n in received if n not in sent]
    for name in sent:
        if name in received and sent[name] != received[name]:
            (d0, s0, c0), (d1, s1, c1) = sent[name], received[name]
            problems.append(f"tensor {name} differs: trainer {d0} {list(s0)} crc32={c0:08x}, "
                            f"engine {d1} {list(s1)} crc32={c1:08x}")
    return problems


@dataclass(frozen=True)
class WeightSyncConfig:
    bucket_mb: float = 256.0
    probe_sequences: int = 2
    probe_length: int = 32
    probe_seed: int = 1234
    # fp32 trainer vs fp32 vLLM agree to ~3e-5 on the tiny models; bf16 needs a looser bound
    probe_tolerance: float = 1e-4

    def validate(self) -> None:
        if self.bucket_mb <= 0:
            raise ValueError(f"WeightSyncConfig.bucket_mb must be > 0, got {self.bucket_mb}")
        if self.probe_sequences < 0 or (self.probe_sequences and self.probe_length < 2):
            raise ValueError("WeightSyncConfig: probe_sequences must be >= 0 and probe_length >= 2")


def _agree(problems: list[str], what: str) -> None:
    """Raises WeightSyncError on every rank if any rank found a problem."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    everyone = [problems]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, problems)
    lines = [f"rank {r}: {p}" for r, probs in enumerate(everyone) for p in probs]
    if lines:
        shown = "\n  ".join(lines[:20]) + (f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else "")
        raise WeightSyncError(f"weight sync verification failed ({what}):\n  {shown}")


class WeightSync:
    """Pushes the trainer's weights into ``engine`` and proves they arrived (see the module docstring)."""

    def __init__(self, engine: RolloutEngine, provider, config: WeightSyncConfig = WeightSyncConfig()):
        config.validate()
        self.engine, self.provider, self.config = engine, provider, config
        self.expected = set(n for n in provider.hf_tensor_shapes("lm"))
        vocab = provider.hf_config.vocab_size
        gen = torch.Generator().manual_seed(config.probe_seed)
        self.probe = torch.randint(0, vocab, (config.probe_sequences, config.probe_length), generator=gen)

    def _buckets(self, model, sent: dict, stats: dict):
        """Full HF tensors from the trainer, released in buckets of at most ``bucket_mb``."""
        limit = int(self.config.bucket_mb * 2**20)
        bucket, size = [], 0
        for name, tensor in iter_hf_weights(model, self.provider):
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > limit:
                yield from self._release(bucket, size, stats)
                bucket, size = [], 0
            sent[name] = tensor_checksum(tensor)
            bucket.append((name, tensor))
            size += nbytes
        if bucket:
            yield from self._release(bucket, size, stats)

    @staticmethod
    def _release(bucket: list, size: int, stats: dict):
        stats["buckets"] += 1
        stats["bytes"] += size
        stats["max_bucket_bytes"] = max(stats["max_bucket_bytes"], size)
        while bucket:  # drop each tensor once vLLM has taken it
            yield bucket.pop(0)

    def sync(self, model: torch.nn.Module) -> dict[str, float]:
        """Loads ``model``'s current weights into the engine and verifies them; returns metrics.

        Collective over all ranks (the gathers inside ``iter_hf_weights`` and the verdict).
        """
        sent, received = {}, {}
        stats = {"buckets": 0, "bytes": 0, "max_bucket_bytes": 0}
        start = time.perf_counter()
        self.engine.load_weights(self._buckets(model, sent, stats),
                                 on_arrival=lambda name, t: received.__setitem__(name, tensor_checksum(t)))
        sync_s = time.perf_counter() - start
        problems = compare_checksums(sent, received)
        if set(sent) != self.expected:
            problems.append(f"the trainer sent {sorted(set(sent) - self.expected)} beyond the HF layout and "
                            f"lacks {sorted(self.expected - set(sent))}")
        _agree(problems, "checksums of the tensors the engine received")
        metrics = {"time/weight_sync_s": sync_s, "weight_sync/bytes": float(stats["bytes"]),
                   "weight_sync/bytes_per_s": stats["bytes"] / max(sync_s, 1e-9),
                   "weight_sync/tensors": float(len(sent)), "weight_sync/buckets": float(stats["buckets"]),
                   "weight_sync/max_bucket_bytes": float(stats["max_bucket_bytes"])}
        if self.config.probe_sequences:
            start = time.perf_counter()
            metrics["weight_sync/probe_max_abs_diff"] = self._probe(model)
            metrics["time/weight_sync_probe_s"] = time.perf_counter() - start
        return metrics

    def _probe(self, model) -> float:
        trainer = token_logprobs(model, self.probe, vocab_size=self.provider.hf_config.vocab_size)
        engine = torch.tensor(self.engine.prompt_logprobs(self.probe.tolist()), dtype=torch.float32)
        diff = (trainer - engine).abs()
        worst = float(diff.max())
        problems = []
        if not worst <= self.config.probe_tolerance:  # also catches nan
            seq, pos = divmod(int(diff.view(-1).nan_to_num(float("inf")).argmax()), diff.shape[1])
            problems.append(f"probe forward: engine vs trainer log-prob max |diff| {worst:.3g} > tolerance "
                            f"{self.config.probe_tolerance:g} (probe sequence {seq}, token {pos + 1})")
        _agree(problems, "probe forward")
        return worst
