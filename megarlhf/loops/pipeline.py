"""Where each RL step's batch comes from: generated inside the step, or one step ahead (off-policy).

``rollout.max_staleness=0`` (:class:`SynchronousBatches`): steps 1-6 run inside the step
(:func:`megarlhf.loops.collect.collect`), with the weights the step starts from.

``rollout.max_staleness=k >= 1`` (:class:`OffPolicyBatches`, disaggregated placement only): the engines
generate the next step's batch while the trainers update on this one. In step ``t`` the trainers take
batch ``t`` (launched during step ``t-1``), launch batch ``t+1`` and return; scoring and the update of
step ``t`` then run while the engines generate. Before the launch the trainers push their weights (those
after ``t`` updates) to the engines only if the engines' weights would otherwise be more than ``k``
updates older than the weights that train on batch ``t+1`` (those after ``t+1`` updates). So ``k`` is a
bound, not a fixed lag: batch ``t`` is sampled with weights between 1 and ``k`` updates behind (step 0's
with the same ones: there is no earlier step), and with ``k=1`` the weights are synced every step, with
``k=2`` every other step. One batch is in flight whatever ``k``: a larger ``k`` saves syncs (the only time
generation and training wait for each other), it does not queue more batches. The update corrects for
the lag exactly as for any rollout/trainer mismatch: the PPO "old" log-probs are the trainer's own (the
proximal policy) and the behaviour log-probs the engines report feed the importance-sampling correction
(``algorithm.mismatch``; its docstring says what that correction does and where it is biased);
``mismatch/*`` then measure the off-policy gap.

Dynamic sampling (DAPO) off-policy: batch ``t`` is scored first; its extra rounds (when too few of its
groups are informative) are generated at once, with the engines' weights brought up to the trainers'
(staleness 0 for those samples), and batch ``t+1`` is launched after them.

Metrics: ``rollout/staleness`` and ``rollout/staleness_mean`` (policy versions between the weights that
sampled each token and those that train on it, the largest and the mean over tokens: a share generated
again after an engine was replaced has the trainers' weights of then, :mod:`megarlhf.loops.rollout_metrics`),
``time/rollout_wait_s`` (trainers waiting for the batch), ``time/engine_generate_s`` and
``time/rollout_overlap_s`` (the part of the generation that ran while the trainers worked).

Resume. The batch in flight when a checkpoint is written is taken from the engines first and saved in
the checkpoint (every replica's samples and metrics, with the prompt indices and the weight version they
were sampled with), so a resumed run trains on exactly the batch the uninterrupted run trained on. When the
data-parallel size changed, the step's prompts (the saved batch's, split over the new replicas) are
generated again with the checkpoint's weights (deterministic, one update fresher than the uninterrupted
run's), and the run says so; a checkpoint without a batch in flight draws the step's prompts as usual.
"""
from __future__ import annotations

import logging

from megarlhf.core.seeds import sample_seed
from megarlhf.loops.collect import Collected, collect, fill_groups, replica_offset, score_round
from megarlhf.rollout.engines.sampling import rollout_sampling
from megarlhf.run.context import RunContext

logger = logging.getLogger(__name__)


class SynchronousBatches:
    """Each step generates its own batch (``rollout.max_staleness=0``)."""

    def __init__(self, run: RunContext, sampler, prompts):
        self.run, self.sampler, self.prompts = run, sampler, prompts

    def next(self, step: int) -> Collected:
        return collect(self.run, self.sampler, self.prompts, step)

    def state(self, next_step: int) -> dict:
        return {}

    def restore(self, state: dict | None, step: int) -> None:
        """Nothing is in flight between synchronous steps."""


class OffPolicyBatches:
    """Batch ``k+1`` is generated during step ``k`` (see the module docstring)."""

    def __init__(self, run: RunContext, sampler, prompts):
        self.run, self.sampler, self.prompts = run, sampler, prompts
        self.phase, self.config, self.runtime = run.rollout, run.config, run.runtime
        self.launched: tuple[int, int, list[int]] | None = None  # (step, weight version, prompt indices)
        self.taken = None  # (RolloutBatch, metrics) received before its step (checkpoint, resume)
        self.last_version: int | None = None  # the weight version the engines hold (None: not synced yet)
        self.regenerate: tuple[int, list[int]] | None = None  # (step, prompt indices) to generate again

    def next(self, step: int) -> Collected:
        metrics = {}
        if self.launched is None or self.launched[0] != step:  # step 0, or a resume without the batch in flight
            again = self.regenerate[1] if self.regenerate is not None and self.regenerate[0] == step else None
            self.regenerate = None
            metrics = self._launch(step, trainer_version=step, indices=again)
        (_, _, indices), self.launched = self.launched, None
        rollout, timing = self.taken if self.taken is not None else self.phase.receive()
        self.taken = None
        dynamic = self.config.algorithm.dynamic_sampling.enabled
        if not dynamic and step + 1 < self.config.train.steps:  # launched now: it overlaps the scoring too
            metrics.update(self._launch(step + 1, trainer_version=step))
        wait, generate = timing.get("time/rollout_wait_s", 0.0), timing.get("time/engine_generate_s", 0.0)
        metrics.update({**timing, "time/rollout_overlap_s": max(generate - wait, 0.0)})
        examples = [self.prompts[i] for i in indices]
        got = score_round(self.run, examples, rollout, metrics)
        if not dynamic:
            return got
        got = fill_groups(self.run, got, self.sampler, self.prompts, step, before_extra_rounds=lambda: self._sync_to(step))
        if step + 1 < self.config.train.steps:
            got.metrics.update(self._launch(step + 1, trainer_version=step))
        return got

    def _sync_to(self, version: int) -> dict[str, float]:
        """Gives the engines the trainers' weights (after ``version`` updates) unless they hold them."""
        if self.last_version == version:
            return {}
        metrics, self.last_version = self.phase.sync(), version
        return metrics

    def _launch(self, step: int, trainer_version: int, indices: list[int] | None = None) -> dict[str, float]:
        """Starts batch ``step`` (``indices``: its prompts, else the sampler's next batch). The engines keep
        their weights if those are at most ``max_staleness`` updates behind the weights that train on it
        (after ``step`` updates), else they get the trainers' (after ``trainer_version`` updates); returns
        the sync's metrics (none without a sync)."""
        sync = self.last_version is None or step - self.last_version > self.config.rollout.max_staleness
        indices = self.sampler.next_batch() if indices is None else indices
        offset, n = replica_offset(self.run), self.config.rollout.n_samples
        sampling = rollout_sampling(self.config.rollout, self.run.stop_token_ids)
        metrics = self.phase.launch([self.prompts[i] for i in indices], sampling,
                                    sample_seed(self.config.seed, step, offset, n), sync_weights=sync)
        if sync:
            self.last_version = trainer_version
        self.launched = (step, self.last_version, indices)
        return metrics

    def state(self, next_step: int) -> dict:
        """The batch in flight for ``next_step`` (taken from the engines now), every replica's, for the
        checkpoint; {} when none is in flight. Collective."""
        if self.launched is None or self.launched[0] != next_step:
            return {}
        self.taken = self.phase.receive()
        step, version, indices = self.launched
        replicas = self.runtime.all_gather_objects((indices, *self.taken), over="dp")
        return {"in_flight": {"step": step, "version": version, "replicas": replicas}}

    def restore(self, state: dict | None, step: int) -> None:
        """Takes the saved batch in flight for ``step`` (see the module docstring)."""
        saved = (state or {}).get("in_flight")
        if saved is None or saved["step"] != step:
            return
        if len(saved["replicas"]) != self.runtime.dp.size:
            # the sampler's saved state has drawn this batch already: its prompts (the replicas' shares in
            # order, i.e. the global batch) are split over this run's replicas as the sampler splits
            everyone = [i for indices, _, _ in saved["replicas"] for i in indices]
            share = len(everyone) // self.runtime.dp.size
            self.regenerate = (step, everyone[self.runtime.dp.rank * share:(self.runtime.dp.rank + 1) * share])
            logger.warning("the batch in flight for step %d was saved by %d data-parallel replicas, this run has "
                           "%d: generating its prompts again with the checkpoint's weights", step,
                           len(saved["replicas"]), self.runtime.dp.size)
            return
        indices, rollout, metrics = saved["replicas"][self.runtime.dp.rank]
        if not getattr(rollout, "policy_versions", None):  # saved before samples carried their versions
            rollout.stamp_versions(saved["version"])
        self.launched, self.last_version = (step, saved["version"], list(indices)), None
        self.taken = (rollout, metrics)


def make_batches(run: RunContext, sampler, prompts):
    """The run's source of batches, as ``rollout.max_staleness`` says."""
    kind = OffPolicyBatches if run.config.rollout.max_staleness else SynchronousBatches
    return kind(run, sampler, prompts)
