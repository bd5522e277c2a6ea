"""Megatron -> rollout-engine weight sync, verified on every call; and the verification both placements use.

:class:`WeightSync` streams the live sharded Megatron model into a colocated engine without touching disk:

1. ``iter_hf_weights`` (the project's one Megatron -> HF mapping; TP all-gather and PP broadcast inside)
   yields full HF-named tensors; :func:`weight_buckets` groups them into buckets of at most
   ``rollout.weight_sync.bucket_mb`` (a tensor larger than that travels alone), so at most one bucket
   of full tensors is alive at a time, never the model.
2. The buckets are handed to the engine's in-place ``load_weights`` (one call for the whole stream).
3. Checksums (CRC-32 of the raw bytes, plus dtype and shape) are taken on the trainer side as tensors
   leave ``iter_hf_weights`` and on the engine side as its loader takes them. vLLM fuses qkv / gate_up
   and repacks linear weights for oneDNN on CPU, so its parameters cannot be compared with HF tensors
   bit for bit; what it received can. Any missing, extra or altered tensor stops the run with a
   :class:`WeightSyncError` naming it.
4. A probe forward: the engine's prompt log-probs of fixed random sequences vs the trainer's, through
   the trainer's own scoring path (:func:`megarlhf.training.compute_logprobs`, the packed forward that
   training uses), gated by the tolerances of :mod:`megarlhf.gates` (max and mean gap); this catches
   what the checksums cannot (a loader that puts a received tensor in the wrong place). The gates are
   calibrated once, before the first sync (:meth:`WeightSync.calibrate`), with the same probe while the
   engine still holds the checkpoint it loaded itself.

The verdict is agreed over the trainer ranks, so every rank raises together instead of one rank leaving
the others waiting in the next collective. The disaggregated placement
(:mod:`megarlhf.rollout.disaggregated`) moves bytes differently but verifies with the same functions.

Hand-written because the bucketing, the two-sided checksums and the probe are megarlhf's own contract;
the engines do the loading and Megatron the gathering.
"""
from __future__ import annotations

import time
import zlib
from typing import Iterable, Iterator

import torch

from megarlhf.gates import Tolerances, calibration_problems, gap_problems, run_tolerances
from megarlhf.rollout.config import WeightSyncConfig
from model_providers.hf_checkpoint import iter_hf_weights

PROBE_SEED = 1234  # the probe's random sequences are the same at every sync


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


def layout_problems(sent: Iterable[str], expected: set[str]) -> list[str]:
    """The trainer must send exactly the HF checkpoint's tensors."""
    sent = set(sent)
    if sent == expected:
        return []
    return [f"the trainer sent {sorted(sent - expected)} beyond the HF layout and lacks {sorted(expected - sent)}"]


def weight_buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_mb: float,
                   stats: dict) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Groups ``(name, tensor)`` pairs into buckets of at most ``bucket_mb`` (a larger tensor alone);
    counts ``buckets``, ``bytes`` and ``max_bucket_bytes`` into ``stats``."""
    limit = int(bucket_mb * 2**20)
    bucket, size = [], 0

    def release():
        stats["buckets"] = stats.get("buckets", 0) + 1
        stats["bytes"] = stats.get("bytes", 0) + size
        stats["max_bucket_bytes"] = max(stats.get("max_bucket_bytes", 0), size)
        return bucket

    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield release()
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield release()


def sync_metrics(stats: dict, tensors: int, seconds: float) -> dict[str, float]:
    return {"time/weight_sync_s": seconds, "weight_sync/bytes": float(stats.get("bytes", 0)),
            "weight_sync/bytes_per_s": stats.get("bytes", 0) / max(seconds, 1e-9),
            "weight_sync/tensors": float(tensors), "weight_sync/buckets": float(stats.get("buckets", 0)),
            "weight_sync/max_bucket_bytes": float(stats.get("max_bucket_bytes", 0))}


def verdict_error(lines: list[str], what: str) -> WeightSyncError:
    shown = "\n  ".join(lines[:20]) + (f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else "")
    return WeightSyncError(f"weight sync verification failed ({what}):\n  {shown}")


def probe_sequences(vocab_size: int, config: WeightSyncConfig) -> torch.Tensor:
    """The probe's fixed random sequences [probe_sequences, probe_length] (host; token ids)."""
    gen = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab_size, (config.probe_sequences, config.probe_length), generator=gen)  # host: ids


def trainer_probe_logprobs(actor, probe: torch.Tensor, config) -> torch.Tensor:
    """The trainer's teacher-forced log-probs [S, L-1] (host, fp32, temperature 1) of the probe
    sequences, through the training forward (collective over the actor's model-parallel group)."""
    from megarlhf.training import ExperienceBatch, compute_logprobs

    sequences = probe.tolist()
    batch = ExperienceBatch.from_sequences([s[:1] for s in sequences], [s[1:] for s in sequences],
                                           device=actor.runtime.device)
    return compute_logprobs(actor, batch, config, temperature=1.0)[:, 1:].cpu()


def probe_problems(trainer: torch.Tensor, engine: torch.Tensor, tolerances: Tolerances
                   ) -> tuple[float, float, list[str]]:
    """(max gap, mean gap, problems) of the probe's trainer vs engine log-probs [S, L-1]."""
    diff = (trainer.float() - engine.float()).abs()
    worst, mean = float(diff.max()), float(diff.mean())
    problems = gap_problems("probe forward", worst, mean, tolerances.probe_max, tolerances.probe_mean,
                            ("probe_max", "probe_mean"))
    if problems and diff.numel():
        seq, pos = divmod(int(diff.view(-1).nan_to_num(float("inf")).argmax()), diff.shape[1])
        problems[0] += f" (largest at probe sequence {seq}, token {pos + 1})"
    return worst, mean, problems


def probe_floor(trainer: torch.Tensor, engine: torch.Tensor) -> tuple[float, float]:
    """(max, mean) |trainer - engine| of a calibration probe."""
    diff = (trainer.float() - engine.float()).abs()
    return float(diff.max()), float(diff.mean())


def calibration_metrics(floor: tuple[float, float], tolerances: Tolerances) -> dict[str, float]:
    return {"gates/calibration_probe_max": floor[0], "gates/calibration_probe_mean": floor[1],
            **{f"gates/{name}": value for name, value in vars(tolerances).items()}}


class WeightSync:
    """Pushes the actor's weights into a colocated ``engine`` and proves they arrived (module docstring).

    ``config`` is the run's ``RunConfig``. ``tolerances`` are the gates' (calibrated by :meth:`calibrate`)."""

    def __init__(self, engine, actor, config):
        self.engine, self.actor, self.config = engine, actor, config
        self.tolerances: Tolerances = run_tolerances(config)
        self.sync_config = config.rollout.weight_sync
        self.runtime = actor.runtime
        self.expected = set(actor.provider.hf_tensor_shapes("lm"))
        self.probe = probe_sequences(actor.provider.hf_config.vocab_size, self.sync_config)

    def _agree(self, problems: list[str], what: str) -> None:
        """Raises WeightSyncError on every trainer rank if any rank found a problem."""
        everyone = self.runtime.all_gather_objects(problems, over="trainers")
        lines = [f"rank {r}: {p}" for r, found in enumerate(everyone) for p in found]
        if lines:
            raise verdict_error(lines, what)

    def calibrate(self) -> dict[str, float]:
        """Sets the gates' tolerances from the probe's gap while the engine holds the checkpoint it loaded
        itself and the actor the same checkpoint (call before the first sync and before a resume loads
        other weights into the actor); returns the calibration metrics. Collective over the trainers."""
        if not self.sync_config.probe_sequences:
            return {}
        trainer = trainer_probe_logprobs(self.actor, self.probe, self.config)
        engine_lp = self.engine.prompt_logprobs(self.probe.tolist())
        engine = torch.tensor(engine_lp, dtype=torch.float32)  # host: compared there
        floors = self.runtime.all_gather_objects(probe_floor(trainer, engine), over="trainers")
        floor = (max(f[0] for f in floors), max(f[1] for f in floors))
        self._agree(calibration_problems(self.config, floor[1]), "calibration before the first sync")
        self.tolerances = run_tolerances(self.config, floor)
        return calibration_metrics(floor, self.tolerances)

    def sync(self) -> dict[str, float]:
        """Loads the actor's current weights into the engine and verifies them; returns metrics.

        Collective over the trainer ranks (the gathers inside ``iter_hf_weights`` and the verdicts).
        """
        sent, received, stats = {}, {}, {}

        def outgoing():
            weights = iter_hf_weights(self.actor.model, self.actor.provider)
            for bucket in weight_buckets(weights, self.sync_config.bucket_mb, stats):
                while bucket:  # drop each tensor once the engine has taken it
                    name, tensor = bucket.pop(0)
                    sent[name] = tensor_checksum(tensor)
                    yield name, tensor

        start = time.perf_counter()
        self.engine.load_weights(outgoing(), on_arrival=lambda name, t: received.__setitem__(name, tensor_checksum(t)))
        seconds = time.perf_counter() - start
        problems = compare_checksums(sent, received) + layout_problems(sent, self.expected)
        self._agree(problems, "checksums of the tensors the engine received")
        metrics = sync_metrics(stats, len(sent), seconds)
        if self.sync_config.probe_sequences:
            start = time.perf_counter()
            trainer = trainer_probe_logprobs(self.actor, self.probe, self.config)
            engine_lp = self.engine.prompt_logprobs(self.probe.tolist())
            engine = torch.tensor(engine_lp, dtype=torch.float32)  # host: compared there
            worst, mean, problems = probe_problems(trainer, engine, self.tolerances)
            self._agree(problems, "probe forward")
            metrics.update({"weight_sync/probe_max_abs_diff": worst, "weight_sync/probe_mean_abs_diff": mean,
                            "time/weight_sync_probe_s": time.perf_counter() - start})
        return metrics
