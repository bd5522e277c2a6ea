"""The trainer ranks' side of the disaggregated placement: the engine ranks as the trainers see them.

Every method is collective over the trainer ranks (the gathers of ``iter_hf_weights``, the verdicts).

* :meth:`RemoteEngines.sync`: ``iter_hf_weights`` yields full HF tensors; the source packs them into
  buckets of at most ``bucket_mb``, broadcasts each to the engine ranks and fingerprints each tensor at its
  place in the engines' parameters as it goes; every engine loads them in one load session and compares
  the fingerprints of what it computes with, bit for bit. Then the probe forward against each engine.
* :meth:`RemoteEngines.launch` / :meth:`RemoteEngines.receive`: each data-parallel replica's prompts go
  to the source and are split round-robin over the engines; ``launch`` returns once they are sent, so the
  trainers can work while the engines generate (one-step off-policy training). Each prompt keeps its own
  replica's seeds (:func:`~.protocol.merged_sampling`), so samples depend neither on the number of engine
  ranks nor on the other replicas. Tool counts of multi-turn episodes come back summed over the engines
  and are reported by the first replica's ranks (the others report zeros, so the usual sum over replicas
  gives the totals).
"""
from __future__ import annotations

import time

import torch.distributed as dist

from megarlhf.data.prompts import PromptExample
from megarlhf.core.dtypes import torch_dtype
from megarlhf.rollout.disaggregated.engine_side import RESTARTED, RESTARTS_METRIC, EngineFailedError
from megarlhf.rollout.disaggregated.protocol import Channel, InFlight, merged_sampling
from megarlhf.rollout.engines.fingerprint import to_host
from megarlhf.rollout.engines.sampling import RolloutBatch, SamplingConfig
from megarlhf.rollout.sync.adapters import SLOTS_CHECK, adapter_metrics, adapter_slot_rank, expected_slots
from megarlhf.rollout.sync.calibration import (CHECKPOINT_CHECK, FLOORS_CHECK, calibration_metrics, checkpoint_verified,
                                               checks_checkpoint, decide_natural_floor, floor_problems, natural_gap,
                                               natural_sampling, replica_share, trainer_fingerprints, worst_of)
from megarlhf.rollout.sync.held import HeldWeights
from megarlhf.rollout.sync.gates import run_tolerances
from megarlhf.rollout.sync.weights import (SYNC_CHECK, ExpectedFingerprints, layout_problems, longest_probe_length,
                                           probe_sequences, sync_metrics, trainer_probe_logprobs, verdict_error,
                                           weight_buckets)
from model_providers.hf_checkpoint import iter_hf_weights
from model_providers.peft_adapter import peft_config, peft_tensors
from parallel.lora import adapters_disabled, merge_rounding


class RemoteEngines:
    """The engine ranks, for a trainer rank holding ``actor`` (its TrainModel). Collective to build."""

    def __init__(self, config, channel: Channel, actor, adapter_only: bool = False):
        self.config, self.channel, self.actor, self.adapter_only = config, channel, actor, adapter_only
        self.runtime, self.sync_config = actor.runtime, config.rollout.weight_sync
        self.tolerances = run_tolerances(config)
        self.hf_shapes = actor.provider.hf_tensor_shapes("lm")
        self.engine_dtype = torch_dtype(config.rollout.engine_dtype(config.model.dtype))
        self.placement = self.fused = None  # the engines' layout (the source's), asked for once
        self.probe = probe_sequences(actor.provider.hf_config.vocab_size, self.sync_config,
                                     longest_probe_length(config))
        self.held = HeldWeights(actor.model, self.runtime)  # what the engines hold (full syncs only)
        self.floor: tuple[float, float] | None = None  # the probe's calibration floor (calibration sets both)
        self.natural_deferred = False
        self.calibrating = False  # the actor's LoRA adapters are off (calibrate)
        self.version = actor.policy_version  # the policy version the engines hold (model.path: the start's)

    def _engine_layout(self) -> dict[str, tuple[str, int]] | None:
        """Source: where each HF tensor sits in the engines' parameters (asked once; every engine runs the
        same model class). None on the other trainer ranks."""
        if self.channel.is_source and self.placement is None:
            self.channel.broadcast(("layout", self.hf_shapes))
            self.fused, self.placement = self.channel.from_engines()[0]
        return self.placement

    def calibrate(self, prompts: list[list[int]] = (), stop_token_ids: tuple[int, ...] = (),
                  natural_at_step0: bool = False) -> dict[str, float]:
        """The gates' calibration (:mod:`megarlhf.rollout.sync.calibration`) against every engine while it
        holds the checkpoint it loaded itself; ``prompts`` (token ids, the same on every rank) are sampled for
        the natural floor (unless ``natural_at_step0`` leaves it to step 0). Returns the calibration metrics.
        The actor computes with its LoRA adapters off (the engines hold model.path, the base)."""
        self.calibrating = True
        try:
            with adapters_disabled(self.actor.model):
                return self._calibrate(prompts, stop_token_ids, natural_at_step0)
        finally:
            self.calibrating = False

    def _calibrate(self, prompts, stop_token_ids, natural_at_step0: bool) -> dict[str, float]:
        channel, checked = self.channel, checks_checkpoint(self.config)
        if checked:
            expected = trainer_fingerprints(self.actor, self._engine_layout(), self.engine_dtype)  # collective
            if channel.is_source:
                channel.broadcast(("checkpoint", expected))
            channel.trainer_verdict([], CHECKPOINT_CHECK)
            checkpoint_verified(self)
        floor = natural = None
        if self.probe:
            trainer = trainer_probe_logprobs(self.actor, self.probe, self.config)  # every trainer rank
            if channel.is_source:
                channel.broadcast(("calibrate", self.probe, trainer))
                floor = worst_of(channel.from_engines())
            floor = channel.to_trainers(floor)
            self.tolerances = run_tolerances(self.config, floor)  # a probe after a restart (natural sampling)
        if prompts and not decide_natural_floor(self, prompts, natural_at_step0):
            # each replica sends its share (an empty one asks for nothing) and scores what it received
            mine, indices = replica_share(list(prompts), self.runtime)
            sampling = natural_sampling(self.config, stop_token_ids).for_prompts(indices)
            batch = self.receive(self.launch(mine, sampling))[0]
            natural = worst_of(self.runtime.all_gather_objects(natural_gap(self.actor, batch, self.config),
                                                               over="trainers"))
        problems = floor_problems(self.config, floor, natural, self.actor.provider.is_moe)
        if problems:
            raise verdict_error(problems, FLOORS_CHECK)
        self.floor, self.tolerances = floor, run_tolerances(self.config, floor, natural)
        return calibration_metrics(floor, natural, checked, self.tolerances)

    def sync(self) -> dict[str, float]:
        """Pushes the actor's weights to every engine, verified; returns metrics. Raises
        :class:`~megarlhf.rollout.sync.weights.WeightSyncError` on every rank if any engine got something else."""
        if self.adapter_only:
            metrics = self._until_no_engine_restarted(self._sync_adapter)
        else:
            metrics = self.held.sync_unless_held(self._send_and_verify)  # nothing sent if the engines hold it
        self.version = self.actor.policy_version
        return metrics

    def _send_and_verify(self) -> dict[str, float]:
        return self._until_no_engine_restarted(self._send_weights)

    def _until_no_engine_restarted(self, send) -> dict[str, float]:
        """``send()`` (a sync: its metrics and whether an engine was replaced during it) and the probe forward,
        again while an engine was replaced during either (the new one holds model.path: it must get it all)."""
        while True:
            metrics, restarted = send()
            probe, probe_restarted = self._probe_forward(skip=restarted)
            if not (restarted or probe_restarted):
                return {**metrics, **probe}

    def _send_weights(self) -> tuple[dict[str, float], bool]:
        channel, sent, stats = self.channel, [], {}
        if channel.is_source:
            expected = ExpectedFingerprints(self._engine_layout(), self.engine_dtype)
            channel.broadcast(("sync",))
        start = time.perf_counter()
        weights = iter_hf_weights(self.actor.model, self.actor.provider, copies=False)  # collective (trainers)
        for bucket in weight_buckets(weights, self.sync_config.bucket_mb, stats):
            if channel.is_source:
                expected.add_bucket(bucket)
                channel.send_bucket(bucket)
                sent += [name for name, _ in bucket]
        problems = []
        if channel.is_source:
            channel.end_buckets()
            channel.broadcast(expected.result())
            problems = layout_problems(sent, set(self.hf_shapes))
        restarted = RESTARTED in channel.trainer_verdict(problems, SYNC_CHECK)
        metrics = channel.to_trainers(sync_metrics(stats, len(sent), time.perf_counter() - start)
                                      if channel.is_source else None)
        rounding = merge_rounding(self.actor.model)  # this trainer rank's adapters (LoRA), as in colocated syncs
        if rounding is not None:
            metrics["weight_sync/lora_merge_rounding"] = rounding
        return metrics, restarted

    def _sync_adapter(self) -> tuple[dict[str, float], bool]:
        """Adapter-only sync (megarlhf.rollout.sync.adapters): the source sends the adapters as one bucket and
        its prediction of every engine's adapter slots; returns the sync's metrics and whether an engine was
        replaced during it."""
        channel, lora = self.channel, self.config.model.lora
        if channel.is_source:
            self._engine_layout()
        start, problems = time.perf_counter(), []
        tensors = peft_tensors(self.actor.model, self.actor.provider, lora)  # collective over the trainer ranks
        if channel.is_source:
            try:  # predicted before anything is sent: an error here still follows the protocol below
                host = {name: t.detach().cpu() for name, t in tensors.items()}  # host: predicted as the engine does
                expected = to_host(expected_slots(host, self.fused, max_rank=adapter_slot_rank(self.config),
                                                  dtype=self.engine_dtype, scale=lora.scale))
            except Exception as err:  # noqa: BLE001 - every rank raises with it at the verdict
                expected, problems = {}, [f"the trainer could not predict the engines' adapter slots: {err}"]
            channel.broadcast(("adapter", peft_config(self.actor.provider, lora, self.config.model.path)))
            channel.send_bucket(list(tensors.items()))  # from the trainer's device, as weight buckets travel
            channel.broadcast(expected)
        restarted = RESTARTED in channel.trainer_verdict(problems, SLOTS_CHECK)
        return channel.to_trainers(adapter_metrics(tensors, time.perf_counter() - start) if channel.is_source
                                   else None), restarted

    def _probe_forward(self, skip: bool = False) -> tuple[dict[str, float], bool]:
        """The probe forward after a sync (every engine against the trainers' log-probs; ``skip``: none, the
        sync is sent again); its metrics and whether an engine was replaced during it."""
        metrics, start, probe = {}, time.perf_counter(), None
        if self.sync_config.probe_sequences and not skip:
            trainer = trainer_probe_logprobs(self.actor, self.probe, self.config)  # every trainer rank
            probe = (self.probe, trainer, self.tolerances)
        if self.channel.is_source:
            self.channel.broadcast(probe)
        answers = self.channel.trainer_verdict([], "probe forward")
        gaps = [gap for gap in answers if gap != RESTARTED]
        if probe is not None and gaps:
            metrics.update({"weight_sync/probe_max_abs_diff": max(g[0] for g in gaps),
                            "weight_sync/probe_mean_abs_diff": max(g[1] for g in gaps),
                            "time/weight_sync_probe_s": time.perf_counter() - start})
        return metrics, RESTARTED in answers

    def launch(self, prompts: list, sampling: SamplingConfig, episodes: bool = False) -> InFlight:
        """Sends this replica's ``prompts`` to the engines and returns at once (module docstring). Ranks of
        one replica pass the same prompts and sampling. Nothing else may use the engines until
        :meth:`receive` took the batch. ``episodes``: ``prompts`` are PromptExamples whose whole multi-turn
        episodes the engine ranks run; else token ids, one model turn per sample."""
        sampling.validate(len(prompts))
        if episodes and (self.config.rollout.env is None or not all(isinstance(p, PromptExample) for p in prompts)):
            raise TypeError("RemoteEngines.launch: episodes need rollout.env and PromptExamples")
        everyone = [None] * self.runtime.trainers.size
        sent = list(prompts) if episodes else [list(map(int, p)) for p in prompts]  # PromptExamples pickle whole
        dist.all_gather_object(everyone, (self.runtime.dp.rank, sent, sampling), group=self.channel.trainers)
        replicas: dict[int, list] = {}
        samplings: dict[int, SamplingConfig] = {}
        for rank, (dp, theirs, their_sampling) in enumerate(everyone):
            if (replicas.setdefault(dp, theirs), samplings.setdefault(dp, their_sampling)) != (theirs, their_sampling):
                raise ValueError(f"disaggregated rollout: trainer rank {rank} passed prompts or sampling that differ "
                                 f"from its data-parallel replica {dp}'s (its model-parallel peers must agree)")
        order = [(dp, i) for dp in sorted(replicas) for i in range(len(replicas[dp]))]
        merged = merged_sampling(samplings, order)  # on every trainer rank: a refusal raises on all of them
        request = InFlight(order, replicas, {dp: s.max_new_tokens for dp, s in samplings.items()}, episodes, merged,
                           self.version)
        if self.channel.is_source:
            self.channel.broadcast(("generate", request.sent(), merged, episodes))
        return request

    def receive(self, request: InFlight) -> tuple[RolloutBatch, dict[str, float]]:
        """Waits for the batch :meth:`launch` asked for; returns this rank's share (``prompt_index`` indexes
        its prompts; each sample stamped with the policy version that generated it), ``time/rollout_wait_s`` (how
        long the trainers waited here) and ``time/engine_generate_s`` (the slowest engine's generation time)."""
        start, asked = time.perf_counter(), list(range(len(request.order)))  # the request's prompts asked for
        samples, generate_s, tools, restart_s, version = [], 0.0, {}, 0.0, request.version
        while True:
            answer = self._answers(asked) if self.channel.is_source else None
            found, seconds, their_tools, lost, failed = self.channel.to_trainers(answer)
            samples += [(*sample, version) for sample in found]
            generate_s += seconds
            for name, value in their_tools.items():  # the restart count is a total: the last answer's
                tools[name] = value if name == RESTARTS_METRIC else tools.get(name, 0.0) + value
            if failed:
                raise EngineFailedError(f"disaggregated rollout: {failed}")
            if not lost:
                break
            # a replaced engine holds model.path: sync it (verified) and ask for its share again, seeds kept
            begin = time.perf_counter()
            self._resync()
            restart_s += time.perf_counter() - begin
            asked, version = lost, self.version  # the share is generated again with the trainers' weights of now
            if self.channel.is_source:
                sent = request.sent()
                self.channel.broadcast(("generate", [sent[i] for i in lost], request.sampling.for_prompts(lost),
                                        request.episodes))
        samples.sort(key=lambda s: s[0])
        batch = _replica_batch(samples, request, self.runtime.dp.rank)
        # the engines' totals, reported once: replica 0's ranks carry them, the others zeros (summed over replicas)
        tools = {name: value if self.runtime.dp.rank == 0 else 0.0 for name, value in tools.items()}
        return batch, {"time/rollout_wait_s": time.perf_counter() - start, "time/engine_generate_s": generate_s,
                       "time/engine_restart_sync_s": restart_s, **tools}

    def _resync(self) -> dict[str, float]:
        """After an engine was replaced: the trainers' weights to every engine again, verified. During the
        calibration the engines compute with the base (adapters off): an adapter-only run's new engine loaded it
        itself, and a merged LoRA run's base sent now is not the policy a later sync must not skip."""
        if self.adapter_only:
            return {} if self.calibrating else self.sync()
        metrics = self.held.resend(self._send_and_verify)
        if self.calibrating and self.config.model.lora is not None:
            self.held.forget()
        self.version = self.actor.policy_version
        return metrics

    def _answers(self, asked: list[int]) -> tuple[list, float, dict[str, float], list[int], str | None]:
        """Source: the engines' answers to a request for the prompts ``asked`` (indices into the request, in
        the order sent): their samples (indexed into the request), the slowest engine's seconds, the tool and
        restart counts summed over the engines, the prompts of engines that were replaced meanwhile (to ask
        again), and the first failure (an engine that could not be replaced), naming its rank."""
        samples, tools, lost, failed = [], {}, [], None
        parts = self.channel.from_engines()
        for engine, (part, _, counts, status) in enumerate(parts):
            for name, value in counts.items():
                tools[name] = tools.get(name, 0.0) + value
            if status is None:
                samples += [(asked[s[0]], *s[1:]) for s in part]
            elif status[0] == "restarted":
                lost += asked[engine::len(parts)]  # its round-robin share (engine_side.EngineServer._generate)
            elif failed is None:
                failed = f"engine rank {self.channel.engine_ranks[engine]}: {status[1]}"
        return samples, max(seconds for _, seconds, _, _ in parts), tools, sorted(lost), failed

    def stop_engines(self) -> None:
        """Ends the engines' serve loop (call once, from every trainer rank)."""
        if self.channel.is_source:
            self.channel.broadcast(("stop",))


def _replica_batch(samples: list[tuple], request: InFlight, dp_rank: int) -> RolloutBatch:
    """The samples of replica ``dp_rank``'s prompts, in the engines' (stable) order; a sample generated for
    another replica's larger ``max_new_tokens`` is cut at this replica's own."""
    batch, episodes, limit = RolloutBatch(), request.episodes, request.max_new_tokens.get(dp_rank)
    for item, response, logprobs, finish, mask, env_reward, calls, record, version in samples:
        dp, i = request.order[item]
        if dp != dp_rank:
            continue
        prompt = request.replicas[dp][i]
        if not episodes and len(response) > limit:
            response, logprobs, finish = response[:limit], logprobs[:limit], "length"
            record = None if record is None else record[:len(prompt) + limit]
        if record is not None:
            batch.routed_experts.append(record)
        batch.prompt_index.append(i)
        batch.prompt_ids.append(list(prompt.prompt_ids) if episodes else prompt)
        batch.response_ids.append(list(response))
        batch.logprobs.append(list(logprobs))
        batch.finish_reasons.append(finish)
        batch.policy_versions.append([version] * len(response))
        if episodes:
            batch.loss_masks.append(list(mask))
            batch.env_rewards.append(env_reward)
            batch.tool_calls.append(calls)
    return batch
