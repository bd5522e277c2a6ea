"""One-step off-policy resume at another data-parallel size, with the phase, the scoring and the ranks
faked: the batch that was in flight is generated again from its own prompts, re-split over the new
replicas, instead of the sampler drawing the batch after it (which would skip a batch)."""
from __future__ import annotations

from types import SimpleNamespace

from megarlhf.config import RunConfig, load_config
from megarlhf.data.sampler import PromptSampler
from megarlhf.rollout.engines.sampling import RolloutBatch
from megarlhf.loops import pipeline
from megarlhf.loops.pipeline import OffPolicyBatches


class FakePhase:
    def __init__(self):
        self.launched = []

    def launch(self, prompts, sampling, seed, sync_weights):
        self.launched.append(list(prompts))
        return {}

    def receive(self):
        return RolloutBatch(), {}


def _batches(config, dp_rank, dp_size, sampler_state=None):
    sampler = PromptSampler(64, config.train.global_batch_size, seed=3, dp_rank=dp_rank, dp_size=dp_size)
    if sampler_state is not None:
        sampler.load_state_dict(sampler_state)
    runtime = SimpleNamespace(dp=SimpleNamespace(rank=dp_rank, size=dp_size),
                              all_gather_objects=lambda obj, over: [obj])
    run = SimpleNamespace(rollout=FakePhase(), config=config, runtime=runtime, stop_token_ids=())
    batches = OffPolicyBatches(run, sampler, list(range(64)))
    return batches, sampler


def test_a_resume_at_another_dp_size_regenerates_the_batch_in_flight(monkeypatch):
    monkeypatch.setattr(pipeline, "score_round", lambda run, examples, *args: examples)
    config = load_config(RunConfig, None, ["model.path=unused", "data.train_path=unused.jsonl", "train.steps=4",
                                           "train.global_batch_size=4", "rollout.max_staleness=1",
                                           "rollout.placement={mode: disaggregated, num_engine_ranks: 1}"])
    # the uninterrupted run at DP2: step 0 trains on its batch and launches step 1's
    replicas, in_flight = [], []
    for rank in (0, 1):
        batches, sampler = _batches(config, rank, 2)
        assert batches.next(0) == batches.phase.launched[0]
        in_flight.append(batches.phase.launched[1])
        replicas.append(batches.state(1)["in_flight"]["replicas"][0])
    saved = {"in_flight": {"step": 1, "version": 0, "replicas": replicas}}
    # resumed at DP1 from the checkpoint written after step 0 (the sampler has drawn step 1's batch)
    batches, _ = _batches(config, 0, 1, sampler.state_dict())
    batches.restore(saved, 1)
    assert batches.next(1) == in_flight[0] + in_flight[1]  # step 1's prompts, not step 2's
