"""Disaggregated rollouts: trainer ranks (Megatron) and engine ranks (vLLM) apart, weights synced over the
process group. References: the trainer's own greedy decoding and teacher-forced log-probs of the engines'
samples, before and after 3 AdamW steps + a re-sync; bitwise-equal engine parameters (fingerprints);
a corrupted sync stops trainer and engine ranks with the tensor's name."""
from __future__ import annotations

from pathlib import Path

import pytest

from megarlhf.config.rollout import RolloutPlacementConfig
from megarlhf.testing.launch import read_rank_results, run_torchrun
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_disaggregated

WORKER = Path(__file__).with_name("_worker_disaggregated.py")
# name -> (ranks, engine ranks): 1 trainer + 1 engine; 2 trainers (DP=2) + 1 engine
LAYOUTS = {"t1e1": (2, 1), "t2e1": (3, 1)}
# both slow (~70 s for the first): the default suite keeps its 15-minute budget; the driver's disaggregated
# tests are in the slow set too
PARAMS = [pytest.param("t1e1", marks=pytest.mark.slow), pytest.param("t2e1", marks=pytest.mark.slow)]
NUM_PROMPTS = 64
TARGET = "engine parameter model.layers.1.mlp.down_proj.weight (as processed for its kernels) differs from the trainer's"


@pytest.fixture(scope="module")
def disaggregated_run(tiny_qwen2, tmp_path_factory):
    cache: dict[str, list[dict]] = {}

    def run(layout: str) -> list[dict]:
        if layout not in cache:
            nproc, engines = LAYOUTS[layout]
            out = tmp_path_factory.mktemp(f"disaggregated_{layout}")
            run_torchrun(WORKER, nproc, [str(engines), str(tiny_qwen2), str(out)], timeout_s=600)
            cache[layout] = read_rank_results(out, nproc)
        return cache[layout]

    return run


def split(results: list[dict], layout: str) -> tuple[list[dict], list[dict]]:
    nproc, engines = LAYOUTS[layout]
    return results[:nproc - engines], results[nproc - engines:]


@pytest.mark.parametrize("layout", PARAMS)
@pytest.mark.parametrize("phase", ["before", "after"])
def test_engines_match_trainer(disaggregated_run, layout, phase):
    trainers, _ = split(disaggregated_run(layout), layout)
    per_replica = NUM_PROMPTS // len(trainers)
    for rank in trainers:
        r = rank[phase]
        assert r["greedy_prompt_index"] == list(range(per_replica))  # every prompt came back, in order
        assert r["greedy_equal"] == per_replica, r["greedy_equal"]
        assert r["sampled_prompt_index"] == [i for i in range(per_replica) for _ in range(2)]
        assert r["sampled_tokens"] > per_replica * 2 * 4
        assert r["logprob_max_diff"] <= 1e-4, r["logprob_max_diff"]
        assert r["greedy_finish"] == ["length"]


@pytest.mark.parametrize("layout", PARAMS)
def test_resync_moves_trained_weights_verified(disaggregated_run, layout):
    trainers, _ = split(disaggregated_run(layout), layout)
    for rank in trainers:
        assert rank["losses"][2] < rank["losses"][0] - 0.5
        changed = sum(a != b for a, b in zip(rank["before"]["trainer_greedy"], rank["after"]["trainer_greedy"]))
        assert changed >= len(rank["before"]["trainer_greedy"]) // 2  # the engines had new weights to match
        calibration = rank["calibration"]
        assert calibration["gates/calibration_probe_mean"] < 1e-5 and calibration["gates/probe_mean"] == 1e-5
        # the engines' own load of the checkpoint equals the trainers' conversion; their samples score alike
        assert calibration["gates/calibration_checkpoint_bitwise"] == 1.0
        assert 0 < calibration["gates/calibration_natural_max"] < 1e-4
        sync0 = rank["sync0"]  # the engines hold what it would send, bit for bit: nothing is sent
        assert sync0["weight_sync/skipped"] == 1.0 and "weight_sync/bytes" not in sync0
        for key in ("sync1",):
            m = rank[key]
            assert m["weight_sync/tensors"] == 26 and m["weight_sync/bytes"] == 1380864
            assert 5 <= m["weight_sync/buckets"] and m["weight_sync/max_bucket_bytes"] <= 0.25 * 2**20
            assert m["weight_sync/probe_max_abs_diff"] <= 1e-4


@pytest.mark.parametrize("layout", PARAMS)
def test_seeded_sampling_repeats(disaggregated_run, layout):
    trainers, _ = split(disaggregated_run(layout), layout)
    for rank in trainers:
        assert rank["seeded_equal"] is True
        assert rank["seeded_prompt_index"] == [i for i in range(8) for _ in range(3)]


@pytest.mark.parametrize("layout", PARAMS)
def test_corrupted_sync_stops_both_sides_naming_the_tensor(disaggregated_run, layout):
    trainers, engines = split(disaggregated_run(layout), layout)
    for rank in trainers:
        assert rank["corrupted"] is not None and TARGET in rank["corrupted"], rank["corrupted"]
        assert rank["corrupted"].startswith("weight sync verification failed (fingerprints of the engine's parameters)")
    for rank in engines:
        assert rank["syncs_served"] == 2  # sync0 sent nothing
        assert rank["serve_error"] == trainers[0]["corrupted"]


@pytest.mark.parametrize("layout", PARAMS)
def test_megatron_groups_cover_only_the_trainers(disaggregated_run, layout):
    trainers, engines = split(disaggregated_run(layout), layout)
    assert all(r["tp_world"] == 1 and r["dp_world"] == len(trainers) for r in trainers)
    assert all(r["megatron_initialized"] is False for r in engines)


def test_placement_config_errors_name_the_field():
    assert RolloutPlacementConfig().num_trainer_ranks(4) == 4
    assert RolloutPlacementConfig("disaggregated", 1).num_trainer_ranks(4) == 3
    with pytest.raises(ValueError, match="num_engine_ranks=2: only the disaggregated mode"):
        RolloutPlacementConfig("colocate", 2).validate(4)
    for bad in (0, 4):
        with pytest.raises(ValueError, match=f"num_engine_ranks={bad}: the disaggregated mode needs"):
            RolloutPlacementConfig("disaggregated", bad).validate(4)
    with pytest.raises(ValueError, match="mode='spread'"):
        RolloutPlacementConfig("spread").validate(4)


def test_init_disaggregated_rejects_a_layout_without_engines():
    # a single process (no launcher) has no rank left for engines; checked before any group exists
    with pytest.raises(ValueError, match="num_trainer_ranks=1 must leave at least one of the 1 ranks"):
        init_disaggregated(ParallelConfig(), num_trainer_ranks=1)


def test_each_replicas_prompts_keep_their_own_seeds_and_limit():
    """The request sent to the engines: replica 0's two running episodes and replica 1's three keep the
    seeds their replicas gave them (rank 0's sampling used to be applied to all five, an IndexError past
    its two seeds); the engines generate up to the largest max_new_tokens; anything else must agree."""
    from megarlhf.rollout.engines.sampling import SamplingConfig
    from megarlhf.rollout.disaggregated.protocol import merged_sampling

    samplings = {0: SamplingConfig(n=1, temperature=1.0, max_new_tokens=8, prompt_seeds=(11, 12)),
                 1: SamplingConfig(n=1, temperature=1.0, max_new_tokens=5, prompt_seeds=(21, 22, 23))}
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    merged = merged_sampling(samplings, order)
    assert merged.prompt_seeds == (11, 12, 21, 22, 23) and merged.max_new_tokens == 8
    assert [merged.for_prompts([i]).prompt_seed(0) for i in range(5)] == [11, 12, 21, 22, 23]
    turn_one = {0: SamplingConfig(n=4, temperature=1.0, max_new_tokens=8, seed=100),
                1: SamplingConfig(n=4, temperature=1.0, max_new_tokens=8, seed=108)}
    assert merged_sampling(turn_one, [(0, 0), (0, 1), (1, 0)]).prompt_seeds == (100, 104, 108)
    with pytest.raises(ValueError, match="replica 1 samples with"):
        merged_sampling({0: samplings[0], 1: SamplingConfig(n=1, temperature=0.5, max_new_tokens=8,
                                                            prompt_seeds=(21, 22, 23))}, order)
