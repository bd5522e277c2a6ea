"""What the trainer ranks and the engine ranks of the disaggregated placement say to each other.

Groups (made by :func:`parallel.runtime.init_disaggregated`): ``trainers`` = the trainer ranks; ``channel``
= {trainer rank 0, the *source*} + the engine ranks (gloo, for objects); ``payload`` = the same ranks over
the device's backend (weight buckets as device tensors: NCCL between GPUs, gloo on CPU). The source
broadcasts a command on ``channel``; the engine ranks answer with :meth:`Channel.from_engines`; a
verdict (problems found on any rank) goes back to every rank, which then all raise together.

Commands, each a tuple whose first item names it: ``("layout", hf_shapes)``, ``("checkpoint", expected)``,
``("calibrate", probe, trainer_logprobs)``, ``("sync",)`` then weight buckets, ``("adapter", peft_config)``
then one bucket, ``("generate", prompts, sampling, episodes)``, ``("stop",)``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megarlhf.rollout.engines.api import WeightBucket
from megarlhf.rollout.engines.sampling import SamplingConfig
from megarlhf.rollout.engines.shared_tensor import shared_buffer
from megarlhf.rollout.sync.weights import verdict_error

SOURCE_RANK = 0  # the trainer rank that talks to the engines


class Channel:
    """This rank's end of the placement's groups (see the module docstring)."""

    @classmethod
    def of_run(cls, config, runtime) -> "Channel":
        """The channel of a run's ``rollout.placement`` (disaggregated)."""
        return cls(runtime, config.rollout.placement.num_trainer_ranks(runtime.launch.world_size))

    def __init__(self, runtime, num_trainers: int):
        self.runtime, self.rank = runtime, runtime.launch.rank
        self.trainers, self.channel, self.payload = runtime.trainers.group, runtime.channel.group, runtime.payload.group
        self.engine_ranks = list(range(num_trainers, runtime.launch.world_size))
        self.is_source = self.rank == SOURCE_RANK

    def broadcast(self, obj=None):
        """From the source to the engine ranks (``obj`` is the source's)."""
        box = [obj]
        dist.broadcast_object_list(box, src=SOURCE_RANK, group=self.channel)
        return box[0]

    def to_trainers(self, obj=None):
        """From the source to the other trainer ranks."""
        box = [obj]
        dist.broadcast_object_list(box, src=SOURCE_RANK, group=self.trainers)
        return box[0]

    def from_engines(self, obj=None) -> list:
        """One object per engine rank, gathered at the source (in engine-rank order; [] elsewhere)."""
        out = [None] * (len(self.engine_ranks) + 1) if self.is_source else None
        dist.gather_object(obj, out, dst=SOURCE_RANK, group=self.channel)
        return out[1:] if out is not None else []

    def send_bucket(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Source: one bucket, its header on ``channel`` and its bytes as one buffer on ``payload``."""
        bucket = WeightBucket.pack(tensors)  # one flat buffer on the trainer's device
        self.broadcast(bucket.meta)
        dist.broadcast(bucket.payload, src=SOURCE_RANK, group=self.payload)

    def end_buckets(self) -> None:
        self.broadcast([])

    def receive_bucket(self) -> WeightBucket | None:
        """Engine ranks: the next bucket, in memory another process of this machine can be handed (None:
        the stream ended)."""
        meta = self.broadcast()
        if not meta:
            return None
        nbytes = sum(record[3] for record in meta)  # WeightBucket.nbytes, before there is a buffer
        bucket = WeightBucket(meta, shared_buffer(nbytes, self.runtime.device))
        dist.broadcast(bucket.payload, src=SOURCE_RANK, group=self.payload)
        return bucket

    def engine_verdict(self, problems: list[str], what: str, metric=None) -> None:
        """Engine ranks: report ``problems`` (and a metric) to the source; raise if any rank had one."""
        self.from_engines((problems, metric))
        lines = self.broadcast()
        if lines:
            raise verdict_error(lines, what)

    def trainer_verdict(self, problems: list[str], what: str) -> list:
        """Trainer ranks: the source merges its own and the engines' problems and tells everyone; returns the
        engines' metrics."""
        lines = metrics = None
        if self.is_source:
            lines = [f"rank {SOURCE_RANK}: {p}" for p in problems]
            metrics = []
            for rank, (found, metric) in zip(self.engine_ranks, self.from_engines()):
                lines += [f"rank {rank}: {p}" for p in found]
                metrics.append(metric)
            self.broadcast(lines)
        lines, metrics = self.to_trainers((lines, metrics))
        if lines:
            raise verdict_error(lines, what)
        return metrics


@dataclass
class InFlight:
    """A generation request the engines are working on (:meth:`RemoteEngines.launch`)."""

    order: list[tuple[int, int]]  # (data-parallel replica, prompt) of every prompt sent, in sending order
    replicas: dict[int, list]  # each replica's prompts (token ids, or PromptExamples of multi-turn episodes)
    max_new_tokens: dict[int, int]  # each replica's own limit (the engines generate for the largest)
    episodes: bool = False  # whole multi-turn episodes of PromptExamples, not single samples of token ids
    sampling: SamplingConfig | None = None  # the merged sampling sent (to ask again for a restarted engine's share)
    version: int = 0  # the policy version the engines held when it was sent

    def sent(self) -> list:
        """The prompts in sending order."""
        return [self.replicas[dp][i] for dp, i in self.order]


def merged_sampling(samplings: dict[int, SamplingConfig], order: list[tuple[int, int]]) -> SamplingConfig:
    """One request's sampling for every replica's prompts (``order``: (replica, prompt) in sending order):
    each prompt keeps its own replica's seed; the engines generate up to the largest ``max_new_tokens``
    (:meth:`RemoteEngines.receive` cuts each replica's samples at its own). Everything else must agree."""
    first = samplings[min(samplings)]
    plain = replace(first, seed=None, prompt_seeds=None, max_new_tokens=1)
    for dp, sampling in samplings.items():
        if replace(sampling, seed=None, prompt_seeds=None, max_new_tokens=1) != plain:
            raise ValueError(f"disaggregated rollout: data-parallel replica {dp} samples with {sampling}, "
                             f"replica {min(samplings)} with {first}: only seeds and max_new_tokens may differ")
    seeds = None
    if any(s.seed is not None or s.prompt_seeds is not None for s in samplings.values()):
        seeds = tuple(samplings[dp].prompt_seed(i) for dp, i in order)
        if None in seeds:
            raise ValueError("disaggregated rollout: some data-parallel replicas sample seeded, some not")
    asking = {dp for dp, _ in order} or set(samplings)  # a replica with no prompt asks for nothing
    return replace(first, seed=None, prompt_seeds=seeds,
                   max_new_tokens=max(samplings[dp].max_new_tokens for dp in asking))
