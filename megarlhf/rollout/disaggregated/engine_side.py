"""The engine ranks of the disaggregated placement: one rollout engine each, serving the trainers' commands.

An engine rank holds no Megatron state. Its engine is built with ``in_process=False``: it must not join
the job's process groups (an in-process vLLM engine's start-up is collective over the default group), so
vLLM runs its engine core in a child process and each weight bucket reaches it as a handle to the shared
memory the bucket was received into. Weights are loaded in one load session per sync and verified against
the source's predicted fingerprints; the probe, the calibration's checks and generation run as the
trainers ask (:mod:`.protocol`). With ``rollout.env`` the rank runs its share's whole multi-turn episodes,
so a tool runs once per call whatever the trainers' layout.
"""
from __future__ import annotations

import itertools
import time

from megarlhf.rollout.disaggregated.protocol import Channel
from megarlhf.rollout.engines.api import RolloutEngine
from megarlhf.rollout.engines.sampling import SamplingConfig
from megarlhf.rollout.sync.adapters import SLOTS_CHECK, AdapterDirectory, load_problems, slot_problems
from megarlhf.rollout.sync.calibration import CHECKPOINT_CHECK, checkpoint_problems
from megarlhf.rollout.sync.weights import SYNC_CHECK, compare_fingerprints, probe_floor, probe_problems


class EngineServer:
    """One engine rank: :meth:`serve` executes the source's commands until it says stop. ``multi_turn`` runs
    whole episodes (None: single-turn runs); ``adapter_only``: LoRA adapters arrive instead of weights."""

    def __init__(self, channel: Channel, engine: RolloutEngine, multi_turn=None, adapter_only: bool = False):
        self.channel, self.engine, self.multi_turn = channel, engine, multi_turn
        self.adapter_directory = AdapterDirectory() if adapter_only else None
        self.handlers = {"sync": self._sync, "adapter": self._adapter, "layout": self._layout,
                         "checkpoint": self._checkpoint, "calibrate": self._calibrate, "generate": self._generate}

    def serve(self) -> None:
        """Runs commands until ``stop``. A failed sync raises :class:`WeightSyncError` here after the trainers
        were told."""
        while True:
            command = self.channel.broadcast()
            if command[0] == "stop":
                if self.multi_turn is not None:
                    self.multi_turn.close()
                self.engine.close()
                return
            if command[0] not in self.handlers:
                raise RuntimeError(f"disaggregated engine rank: unknown command {command[0]!r} from the source")
            self.handlers[command[0]](*command[1:])

    def _layout(self, hf_shapes: dict[str, tuple[int, ...]]) -> None:
        self.channel.from_engines((self.engine.fused_parameters(), self.engine.placement(hf_shapes)))

    def _sync(self) -> None:
        problems = []
        self.engine.begin_load()
        while (bucket := self.channel.receive_bucket()) is not None:
            try:
                self.engine.load_bucket(bucket)
            except Exception as err:  # keep draining the stream so that every rank reaches the verdict
                problems.append(f"the engine failed to load the bucket with {bucket.meta[0][0]}...: {err}")
        report = self.engine.finish_load()
        problems += compare_fingerprints(self.channel.broadcast(), report)  # the source's expected fingerprints
        self.channel.engine_verdict(problems, SYNC_CHECK)
        self._probe()

    def _adapter(self, adapter_config: dict) -> None:
        """Adapter-only sync: one bucket of PEFT tensors, written and loaded as the engine's adapter, its
        slots compared with the source's prediction (megarlhf.rollout.sync.adapters); then the probe."""
        bucket = self.channel.receive_bucket()
        if bucket is None:
            report, problems = {}, ["the source sent no adapter tensors"]
        else:
            report, problems = load_problems(self.adapter_directory, self.engine, dict(bucket.tensors()),
                                             adapter_config)
        expected = self.channel.broadcast()  # the source's expected slots
        self.channel.engine_verdict(problems or slot_problems(expected, report), SLOTS_CHECK)
        self._probe()

    def _probe(self) -> None:
        probe, gaps, problems = self.channel.broadcast(), (float("nan"), float("nan")), []
        if probe is not None:
            ids, trainer, tolerances = probe
            worst, mean, problems = probe_problems(trainer, self.engine.prompt_logprobs(ids), tolerances)
            gaps = (worst, mean)
        self.channel.engine_verdict(problems, "probe forward", metric=gaps)

    def _checkpoint(self, expected: dict[str, tuple[int, int]]) -> None:
        """The calibration's bitwise check: the engine reloads model.path from disk and compares."""
        self.channel.engine_verdict(checkpoint_problems(expected, self.engine.checkpoint_report()), CHECKPOINT_CHECK)

    def _calibrate(self, probe: list[list[int]], trainer) -> None:
        self.channel.from_engines(probe_floor(trainer, self.engine.prompt_logprobs(probe)))

    def _generate(self, prompts: list, sampling: SamplingConfig, episodes: bool) -> None:
        """This engine rank's share of a request (round-robin over the engine ranks): samples of token-id
        prompts, or (``episodes``) whole multi-turn episodes of PromptExamples, with their tool counts."""
        ranks = self.channel.engine_ranks
        mine = list(range(ranks.index(self.channel.rank), len(prompts), len(ranks)))
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
        self.channel.from_engines((samples, time.perf_counter() - start, tools))
