"""DPO / IPO / SimPO and reward-model steps against HF transformers written out by hand, and the same
steps in every 2-rank layout (DP, TP, CP, PP): the loss and gradient do not depend on how the pairs are
split. The reward model exported by megarlhf is HF's ...ForSequenceClassification scoring the same numbers.
"""
from pathlib import Path

import pytest

from megarlhf.testing.launch import read_rank_results, run_torchrun

HERE = Path(__file__).parent
LOSSES = ("dpo", "ipo", "simpo", "rm")


@pytest.fixture(scope="module")
def preference_run(tiny_dirs, tmp_path_factory):
    cache: dict[tuple, list[dict]] = {}

    def run(nproc: int, layout: tuple[int, int, int]) -> list[dict]:
        if (nproc, layout) not in cache:
            out = tmp_path_factory.mktemp("preference")
            run_torchrun(HERE / "_worker_preference.py", nproc,
                         [str(x) for x in layout] + [str(tiny_dirs[0]), str(tiny_dirs[1]), str(out)], timeout_s=600)
            cache[nproc, layout] = read_rank_results(out, nproc)
        return cache[nproc, layout]

    return run


@pytest.mark.parametrize("loss", LOSSES)
def test_step_matches_hf_by_hand(preference_run, loss):
    got = preference_run(1, (1, 1, 1))[0][loss]
    assert got["loss"] == pytest.approx(got["hf_loss"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(got["hf_grad_norm"], rel=1e-5)
    assert got["grad_max_rel"] < 1e-5  # every HF tensor's gradient, through the weight mapping
    if loss == "rm":
        assert got["accuracy"] == got["hf_accuracy"]


def test_exported_reward_model_scores_as_hf_sequence_classifier(preference_run):
    got = preference_run(1, (1, 1, 1))[0]["rm"]
    assert got["export_score_max_diff"] <= 1e-6 * got["export_score_scale"] + 1e-5


def test_learned_reward_scores_standardises_and_clips_like_hf(preference_run):
    got = preference_run(1, (1, 1, 1))[0]["rm"]
    assert got["learned_max_diff"] < 1e-5
    assert 0 < got["learned_clipped"] < 12  # the clip is exercised on some samples, not all


@pytest.mark.parametrize("layout", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["dp2", "tp2", "cp2", "pp2"])
def test_layouts_give_the_single_rank_step(preference_run, layout):
    single = preference_run(1, (1, 1, 1))[0]
    for rank in preference_run(2, layout):
        for loss in LOSSES:
            assert rank[loss]["loss"] == pytest.approx(single[loss]["loss"], rel=2e-6), loss
            assert rank[loss]["grad_norm"] == pytest.approx(single[loss]["grad_norm"], rel=2e-6), loss
            assert rank[loss]["accuracy"] == single[loss]["accuracy"], loss
        assert rank["rm"]["export_score_max_diff"] <= 1e-6 * rank["rm"]["export_score_scale"] + 1e-5
        assert rank["rm"]["learned_max_diff"] < 1e-5
