"""A teacher in a parallel layout of its own (``teacher.parallel``) over the same two ranks as the student.

Reference: HF transformers on the same weights, fp32, the full log_softmax at the scoring temperature, its
top-k and the log-sum of the rest, on each student replica's own rows (the two DP replicas' batches differ in
rows and width). Student DP2 with the teacher at TP2, PP2 and CP2 (one teacher replica scoring both student
replicas' rows) and in the student's own layout; student TP2 with the teacher at DP2 and PP2.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from megarlhf.testing.launch import read_rank_results, run_torchrun

HERE = Path(__file__).parent  # not from conftest: another directory's conftest may hold that module name

SIZES = {1: {"same": [1, 1, 1, 2], "tp2": [2, 1, 1, 1], "pp2": [1, 2, 1, 1], "cp2": [1, 1, 2, 1]},
         2: {"dp2": [1, 1, 1, 2], "pp2": [1, 2, 1, 1]}}  # [tp, pp, cp, dp] of the teacher's runtime


@pytest.fixture(scope="module")
def teacher_runs(tiny_dirs, tmp_path_factory):
    cache = {}

    def run(student_tp: int) -> list[dict]:
        if student_tp not in cache:
            out = tmp_path_factory.mktemp(f"teacher_tp{student_tp}")
            run_torchrun(HERE / "_worker_teacher_layout.py", 2, [str(student_tp), str(tiny_dirs[0]), str(out)],
                         timeout_s=600)
            cache[student_tp] = read_rank_results(out, 2)
        return cache[student_tp]

    return run


@pytest.mark.parametrize("student_tp", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["student_dp2", "student_tp2"])
def test_a_teacher_in_its_own_layout_scores_each_replicas_rows_as_hf(teacher_runs, student_tp):
    ranks = teacher_runs(student_tp)
    if student_tp == 1:  # the two replicas hold different rows, of different widths
        assert ranks[0]["width"] != ranks[1]["width"]
    for rank in ranks:
        assert set(rank["layouts"]) == set(SIZES[student_tp])
        for name, r in rank["layouts"].items():
            assert r["sizes"] == SIZES[student_tp][name], name
            assert r["own_layout"] == (name != "same"), name
            assert r["shapes_match"] and r["topk_ids_equal"], (name, r)
            assert max(r["logprobs"], r["topk_logprobs"], r["rest"]) <= 1e-5, (name, r)
            # the run's groups are back after the teacher was built and scored
            assert (r["run_tp_after"], r["run_dp_after"]) == (student_tp, 2 // student_tp), (name, r)
        assert rank["student_unchanged"]
        dp_group = [0, 1] if student_tp == 1 else [rank["rank"]]
        assert rank["run_gloo_group"] == [dp_group, float(len(dp_group))]
    if student_tp == 2:  # one student replica over both ranks: both hold the same scores, to the bit
        for name in SIZES[2]:
            assert ranks[0]["layouts"][name]["digest"] == ranks[1]["layouts"][name]["digest"], name


def test_each_student_replica_is_scored_once_by_one_teacher_replica_and_read_from_one_rank():
    """Megatron's rank grids for 6 ranks: a TP2 x DP3 student (dp = rank // 2) and a PP2 x DP3 teacher (dp = rank
    % 3). Teacher replica 0 (ranks 0, 3) owns student replicas 0 and 1, replica 1 (ranks 1, 4) owns 2, replica 2
    owns none; student replica 2 (ranks 4, 5) reads from rank 4, the one in its owner."""
    from megarlhf.learner.teacher import _owners, _source_rank

    dp_ranks = [(rank // 2, rank % 3) for rank in range(6)]
    owners = _owners(dp_ranks)
    assert owners == {0: 0, 1: 0, 2: 1}
    assert [_source_rank(dp_ranks, student_dp, owners) for student_dp in range(3)] == [0, 3, 4]
