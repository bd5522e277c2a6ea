"""Megatron -> rollout-engine weight sync, verified on every call; and the verification both placements use.

:class:`WeightSync` streams the live sharded Megatron model into a colocated engine without touching disk:

1. ``iter_hf_weights`` (the project's one Megatron -> HF mapping; TP all-gather and PP broadcast inside)
   yields full HF-named tensors on the trainer's device (no host copy, no pickling);
   :func:`weight_buckets` groups them into buckets of at most ``rollout.weight_sync.bucket_mb`` (a
   tensor larger than that travels alone), so at most one bucket of full tensors is alive at a time.
2. The buckets are handed to the engine's in-place ``load_weights`` (one call for the whole stream).
3. Bitwise verification at the engine's parameters: as each bucket leaves, the trainer fingerprints
   its tensors (:mod:`megarlhf.rollout.engines.fingerprint`, on their device; on a GPU one Triton launch for
   many tensors) cast to the engine's dtype, each at its place in the engine's parameter
   (:class:`ExpectedFingerprints`: vLLM fuses ``q/k/v`` and ``gate/up``); after loading and
   processing, the engine fingerprints the parameters its kernels use
   (:mod:`megarlhf.rollout.engines.weights`). Both sides are read to the host once, as one small
   array each, and compared exactly: no tolerance, any dtype. A missing, extra, altered or stale
   parameter (a dropped bucket, post-load processing that did not run) stops the run with a
   :class:`WeightSyncError` naming it.
4. A probe forward, the second line of defence: the engine's prompt log-probs of fixed random
   sequences (a few short ones and one as long as the run's longest up to ``probe_max_length``, so that
   the positions the run uses are scored: past RoPE scaling boundaries and sliding windows) vs the
   trainer's, through
   the trainer's own scoring path (:func:`megarlhf.learner.compute_logprobs`, the packed forward that
   training uses), gated by the tolerances of :mod:`megarlhf.rollout.sync.gates` (max and mean gap); this catches
   what fingerprints cannot (a kernel that reads correct weights wrongly). The gates are
   calibrated once, before the first sync (:mod:`megarlhf.rollout.sync.calibration`), with the same probe
   while the engine still holds the checkpoint it loaded itself.

A sync of weights the engine already holds, bit for bit, sends nothing (:mod:`megarlhf.rollout.sync.held`).

The verdict is agreed over the trainer ranks, so every rank raises together instead of one rank leaving
the others waiting in the next collective. The disaggregated placement
(:mod:`megarlhf.rollout.disaggregated`) moves bytes differently but verifies with the same functions.
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator

import torch

from megarlhf.core.dtypes import torch_dtype
from megarlhf.rollout.sync.gates import Tolerances, gap_problems, run_tolerances
from megarlhf.rollout.sync.held import HeldWeights
from megarlhf.config.rollout import WeightSyncConfig
from megarlhf.rollout.engines.fingerprint import combine, fingerprint_many, to_host
from megarlhf.core.seeds import PROBE_SEED
from model_providers.hf_checkpoint import iter_hf_weights
from parallel.lora import merge_rounding


SYNC_CHECK = "fingerprints of the engine's parameters"


class WeightSyncError(RuntimeError):
    """The engine's weights are not the trainer's after a sync; the message names what differs."""


class ExpectedFingerprints:
    """The trainer's prediction of the engine's parameter fingerprints, built as tensors are sent: each
    HF tensor cast to the engine's ``dtype`` and fingerprinted at its place
    (:func:`~megarlhf.rollout.engines.weights.fused_placement`)."""

    def __init__(self, placement: dict[str, tuple[str, int]], dtype: torch.dtype):
        self.placement, self.dtype = placement, dtype
        self.parts: dict[str, list[torch.Tensor]] = {}
        self.seconds = 0.0  # host time spent here (on a GPU the kernels' launch; the read waits for them)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.add_bucket([(name, tensor)])

    def add_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Fingerprints a bucket's tensors together (on a GPU: few kernel launches for many tensors)."""
        start = time.perf_counter()
        places = [self.placement.get(name, (name, 0)) for name, _ in bucket]
        cast = [(tensor.to(self.dtype), offset) for (_, tensor), (_, offset) in zip(bucket, places)]
        prints = fingerprint_many(cast)
        for (engine_name, _), value in zip(places, prints):
            self.parts.setdefault(engine_name, []).append(value)
        self.seconds += time.perf_counter() - start

    def result(self) -> dict[str, tuple[int, int]]:
        """Every engine parameter's expected fingerprint, on the host (one transfer)."""
        start = time.perf_counter()
        host = to_host({name: combine(parts) for name, parts in self.parts.items()})
        self.seconds += time.perf_counter() - start
        return host


def hex_fingerprint(value) -> str:
    return "/".join(f"{int(v):08x}" for v in value)


def compare_fingerprints(expected: dict[str, tuple[int, int]], report: dict) -> list[str]:
    """Human-readable differences between the trainer's expected fingerprints and an engine's
    :func:`~megarlhf.rollout.engines.weights.parameter_report` (empty: bitwise identical)."""
    problems, held = list(report["problems"]), set()
    for kind, how in (("parameters", "as the engine holds it"), ("processed", "as processed for its kernels")):
        for name, value in report[kind].items():
            canonical = report["aliases"].get(name, name)
            held.add(canonical)
            want = expected.get(canonical)
            if want is None:
                problems.append(f"engine parameter {name} ({how}) matches no tensor the trainer sent")
            elif tuple(value) != tuple(want):
                problems.append(f"engine parameter {name} ({how}) differs from the trainer's: fingerprint "
                                f"{hex_fingerprint(value)}, trainer {hex_fingerprint(want)}")
    problems += [f"no engine parameter holds the trainer's {name}" for name in expected if name not in held]
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


def probe_sequences(vocab_size: int, config: WeightSyncConfig, longest: int) -> list[list[int]]:
    """The probe's fixed random sequences (token ids): ``probe_sequences`` of ``probe_length`` tokens and one
    of ``longest`` tokens (the run's longest sequence) capped at ``probe_max_length``, so that the probe
    reaches the positions the run uses. No sequence is longer than ``longest``, the most an engine of the
    run can score (a run with short prompts and responses has engines shorter than ``probe_length``).
    Empty without ``probe_sequences``."""
    if not config.probe_sequences:
        return []
    gen = torch.Generator().manual_seed(PROBE_SEED)
    shape = (config.probe_sequences, min(config.probe_length, longest))
    sequences = torch.randint(0, vocab_size, shape, generator=gen).tolist()  # host: ids
    long = min(longest, config.probe_max_length)
    if long > config.probe_length:
        sequences.append(torch.randint(0, vocab_size, (long,), generator=gen).tolist())  # host: ids
    return sequences


def longest_probe_length(config) -> int:
    """The length of the probe's long sequence: the run's longest (prompt plus response budget, the engines'
    max_model_len) less the one token an engine must be left to generate when it scores a prompt."""
    return config.data.max_prompt_length + config.rollout.response_budget - 1


def trainer_probe_logprobs(actor, probe: list[list[int]], config) -> torch.Tensor:
    """The trainer's teacher-forced log-probs [S, L_max - 1] (host, fp32, temperature 1, zero past each
    sequence's end) of the probe sequences, through the training forward (collective over the actor's
    model-parallel group)."""
    from megarlhf.learner import ExperienceBatch, compute_logprobs

    batch = ExperienceBatch.from_sequences([s[:1] for s in probe], [s[1:] for s in probe],
                                           device=actor.runtime.device)
    return compute_logprobs(actor, batch, config, temperature=1.0)[:, 1:].cpu()


def probe_diffs(trainer: torch.Tensor, engine: list[list[float]]) -> list[torch.Tensor]:
    """|trainer - engine| of each probe sequence's scored tokens (``engine``: the engine's prompt log-probs,
    one list per sequence; ``trainer``: :func:`trainer_probe_logprobs`)."""
    if len(engine) != trainer.shape[0]:
        raise ValueError(f"probe: the engine scored {len(engine)} sequences, the trainer {trainer.shape[0]}")
    return [(trainer[i, :len(row)].float() - torch.tensor(row, dtype=torch.float32)).abs()  # host: compared there
            for i, row in enumerate(engine)]


def _max_and_mean(diffs: list[torch.Tensor]) -> tuple[float, float]:
    diff = torch.cat(diffs)
    return float(diff.max()), float(diff.mean())


def probe_floor(trainer: torch.Tensor, engine: list[list[float]]) -> tuple[float, float]:
    """(max, mean) |trainer - engine| over every scored token of a calibration probe."""
    return _max_and_mean(probe_diffs(trainer, engine))


def probe_problems(trainer: torch.Tensor, engine: list[list[float]], tolerances: Tolerances
                   ) -> tuple[float, float, list[str]]:
    """(max gap, mean gap, problems) of the probe's trainer vs engine log-probs."""
    diffs = probe_diffs(trainer, engine)
    worst, mean = _max_and_mean(diffs)
    problems = gap_problems("probe forward", worst, mean, tolerances.probe_max, tolerances.probe_mean,
                            ("probe_max", "probe_mean"))
    if problems:
        peaks = [float(d.nan_to_num(float("inf")).max()) for d in diffs]
        seq = max(range(len(peaks)), key=peaks.__getitem__)
        pos = int(diffs[seq].nan_to_num(float("inf")).argmax())
        problems[0] += f" (largest at probe sequence {seq} of {len(diffs[seq]) + 1} tokens, token {pos + 1})"
    return worst, mean, problems


class WeightSync:
    """Pushes the actor's weights into a colocated ``engine`` and proves they arrived (module docstring).

    ``config`` is the run's ``RunConfig``. ``tolerances`` are the gates' (set by
    :func:`megarlhf.rollout.sync.calibration.calibrate_colocated`)."""

    def __init__(self, engine, actor, config):
        self.engine, self.actor, self.config = engine, actor, config
        self.tolerances: Tolerances = run_tolerances(config)
        self.sync_config = config.rollout.weight_sync
        self.runtime = actor.runtime
        hf_shapes = actor.provider.hf_tensor_shapes("lm")
        self.expected = set(hf_shapes)
        self.fused = engine.fused_parameters()
        self.placement = engine.placement(hf_shapes)
        self.engine_dtype = torch_dtype(config.rollout.engine_dtype(config.model.dtype))
        self.probe = probe_sequences(actor.provider.hf_config.vocab_size, self.sync_config,
                                     longest_probe_length(config))
        self.held = HeldWeights(actor.model, self.runtime)
        self.floor: tuple[float, float] | None = None  # the probe's calibration floor (calibration sets both)
        self.natural_deferred = False

    def agree(self, problems: list[str], what: str) -> None:
        """Raises WeightSyncError on every trainer rank if any rank found a problem."""
        everyone = self.runtime.all_gather_objects(problems, over="trainers")
        lines = [f"rank {r}: {p}" for r, found in enumerate(everyone) for p in found]
        if lines:
            raise verdict_error(lines, what)

    def sync(self) -> dict[str, float]:
        """Loads the actor's current weights into the engine and verifies them; returns metrics. Skipped
        when the engine already holds them (:mod:`megarlhf.rollout.sync.held`).

        Collective over the trainer ranks (the gathers inside ``iter_hf_weights`` and the verdicts).
        """
        return self.held.sync_unless_held(self._send_and_verify)  # nothing sent if the engines hold it

    def _send_and_verify(self) -> dict[str, float]:
        sent, stats = [], {}
        expected = ExpectedFingerprints(self.placement, self.engine_dtype)

        def outgoing():
            weights = iter_hf_weights(self.actor.model, self.actor.provider, copies=False)
            for bucket in weight_buckets(weights, self.sync_config.bucket_mb, stats):
                expected.add_bucket(bucket)
                while bucket:  # drop each tensor once the engine has taken it
                    name, tensor = bucket.pop(0)
                    sent.append(name)
                    yield name, tensor

        start = time.perf_counter()
        report = self.engine.load_weights(outgoing())
        seconds = time.perf_counter() - start
        problems = compare_fingerprints(expected.result(), report) + layout_problems(sent, self.expected)
        self.agree(problems, SYNC_CHECK)
        metrics = sync_metrics(stats, len(sent), seconds)
        metrics.update({"time/weight_sync_fingerprint_trainer_s": expected.seconds,
                        "time/weight_sync_fingerprint_engine_s": report["seconds"]})
        rounding = merge_rounding(self.actor.model)
        if rounding is not None:  # LoRA: the share of the adapters' update the merged weights lost
            metrics["weight_sync/lora_merge_rounding"] = rounding
        return {**metrics, **self.probe_forward()}

    def probe_forward(self) -> dict[str, float]:
        """The probe (module docstring, step 4) after a sync; its metrics ({} without probe sequences)."""
        if not self.sync_config.probe_sequences:
            return {}
        start = time.perf_counter()
        trainer = trainer_probe_logprobs(self.actor, self.probe, self.config)
        engine = self.engine.prompt_logprobs(self.probe)
        worst, mean, problems = probe_problems(trainer, engine, self.tolerances)
        self.agree(problems, "probe forward")
        return {"weight_sync/probe_max_abs_diff": worst, "weight_sync/probe_mean_abs_diff": mean,
                "time/weight_sync_probe_s": time.perf_counter() - start}
