"""Every registered advantage estimator through the real driver (``train_rl``), 2 RL steps at DP2 on the
tiny model, with the policy losses it is meant for and each KL mode, in one torchrun launch.

Each run must pass the step-0 gate (trainer log-probs equal the engine's, ``actor/ppo_kl`` = 0) and
record finite metrics; what an estimator declares it needs decides what is built (a critic for GAE, a
greedy baseline for ReMax, a reference model only when KL has weight). Three runs also cover defects
that only a full run shows: ``kl.coef=0`` with the default ``kl_mode`` (no reference, no failure after
step 0), an eval set of one prompt at DP2 (evaluation must not hang), and DAPO's dynamic sampling with
clip-higher + dual clip (refill rounds, and an all-uniform batch that skips its update without crashing).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megarlhf.algorithms import ADVANTAGE_ESTIMATORS
from megarlhf.testing.launch import read_rank_results, run_torchrun
from model_providers.tiny_models import make_tiny_model

from _rl_recipe import write_recipe

WORKER = Path(__file__).with_name("_worker_rl_matrix.py")
# the fake engine: samples drawn from their seeds, scored by the synced weights (the driver's machinery is under
# test here, not an engine; the real engines run through the same driver in test_rl.py)
ENGINE = ["rollout.backend=fake", "reward.functions=[{name: '_rewards:even_length'}]", "eval.every=0"]
DUAL = ["algorithm.policy.clip_eps_high=0.28", "algorithm.policy.dual_clip_c=3.0"]

# estimator -> the policy losses it is meant for (each paired with one KL mode in turn)
MEANT_FOR = {
    "gae": [["algorithm.policy_loss=ppo_clip"], ["algorithm.policy_loss=ppo_clip", *DUAL]],
    "grpo": [["algorithm.policy_loss=ppo_clip"], ["algorithm.policy_loss=gspo",
                                                  "algorithm.loss_aggregation=seq_mean_token_mean"],
             ["algorithm.policy_loss=cispo"]],
    "dr_grpo": [["algorithm.policy_loss=ppo_clip", "algorithm.loss_aggregation=seq_mean_token_sum_norm"]],
    "rloo": [["algorithm.policy_loss=ppo_clip"], ["algorithm.policy_loss=vanilla_pg"]],
    "remax": [["algorithm.policy_loss=vanilla_pg"], ["algorithm.policy_loss=ppo_clip"]],
    "reinforce_pp": [["algorithm.policy_loss=ppo_clip"]],
    "reinforce_pp_baseline": [["algorithm.policy_loss=ppo_clip"], ["algorithm.policy_loss=cispo"]],
    # no task advantage: learns from a teacher alone (another tiny model, TEACHER), by either distillation term
    "none": [["teacher={model_path: TEACHER}", "algorithm.distill={loss: reverse_kl}"],
             ["teacher={model_path: TEACHER}", "algorithm.distill={loss: gkd, top_k: 4}"]],
}
KL_MODES = ["loss", "reward", "none"]


def _cases(teacher: str = "TEACHER") -> dict[str, list[str]]:
    cases = {}
    for estimator in ADVANTAGE_ESTIMATORS.names():
        losses = MEANT_FOR[estimator]  # a new estimator must say which losses it is meant for
        # an estimator that reads no reward is refused a KL penalty in the reward (tests/run/test_distill_checks.py)
        modes = KL_MODES if ADVANTAGE_ESTIMATORS.get(estimator).needs.rewards else ["loss", "none"]
        for i, kl_mode in enumerate(modes):
            loss = [override.replace("TEACHER", teacher) for override in losses[i % len(losses)]]
            cases[f"{estimator}-{kl_mode}"] = [f"algorithm.estimator={estimator}", f"algorithm.kl_mode={kl_mode}",
                                               *loss, *ENGINE]
    cases["kl_coef_0"] = ["algorithm.kl_mode=loss", "algorithm.kl.coef=0.0", *ENGINE]
    cases["eval_one_prompt"] = [*ENGINE, "eval.every=1", "eval.max_prompts=1"]
    cases["dapo"] = ["algorithm.dynamic_sampling={enabled: true, max_extra_rounds: 2}", *DUAL, *ENGINE,
                     "algorithm.kl_mode=none"]
    cases["dapo_uniform"] = ["algorithm.dynamic_sampling={enabled: true, max_extra_rounds: 1}", *ENGINE,
                             "reward.functions=[{name: exact_match}]", "algorithm.kl_mode=none"]
    return cases


# Every estimator, loss and KL mode through the 2-rank driver: one run, in the slow set (make test-slow)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, rl_assets):
    root = tmp_path_factory.mktemp("rl_matrix")
    recipe = write_recipe(root / "recipe.yaml", rl_assets, "grpo", root / "unused")
    cases = root / "cases.json"
    teacher = make_tiny_model("qwen2", root / "teacher", seed=3)  # not the actor: its advantage is not 0
    cases.write_text(json.dumps(_cases(teacher=str(teacher))))
    run_torchrun(WORKER, 2, [str(recipe), str(cases), str(root / "out")], timeout_s=1500)
    ranks = read_rank_results(root / "out", 2)
    return ranks[0]


def _steps(result: dict) -> list[dict]:
    return [r for r in result["metrics"] if r.get("actor/loss") is not None or r.get("actor/skipped_steps")]


@pytest.mark.parametrize("case", [c for c in _cases() if not c.startswith(("dapo", "eval", "kl_coef"))])
def test_estimator_loss_kl_runs_through_the_driver(matrix, case):
    result = matrix[case]
    assert result["error"] is None, result["error"]
    steps = _steps(result)
    assert [r["step"] for r in steps] == [0, 1]
    step0 = steps[0]
    assert step0["mismatch/step0_logprob_gap_max"] < 1e-3 and step0["mismatch/step0_logprob_gap_mean"] < 1e-4
    assert abs(step0["actor/ppo_kl"]) <= 1e-6
    for record in steps:
        assert all(v is None or math.isfinite(v) for v in record.values())
        assert record["actor/skipped_steps"] == 0 and math.isfinite(record["actor/grad_norm"])
    estimator, kl_mode = case.rsplit("-", 1)
    needs = ADVANTAGE_ESTIMATORS.get(estimator).needs
    assert ("critic/value_loss" in step0) == needs.critic
    assert (steps[1]["actor/kl_loss"] != 0) == (kl_mode == "loss")  # step 1: the actor has moved away


def test_kl_coef_zero_in_loss_mode_needs_no_reference(matrix):
    result = matrix["kl_coef_0"]
    assert result["error"] is None, result["error"]
    assert [r["step"] for r in _steps(result)] == [0, 1]
    assert all(r["actor/kl_loss"] == 0 for r in _steps(result))


def test_eval_set_smaller_than_the_data_parallel_size(matrix):
    result = matrix["eval_one_prompt"]
    assert result["error"] is None, result["error"]
    evals = [r for r in result["metrics"] if r.get("eval/prompts") is not None]
    assert [r["step"] for r in evals] == [0, 1, 2] and all(r["eval/prompts"] == 1 for r in evals)


def test_dapo_dynamic_sampling_refills_informative_groups(matrix):
    result = matrix["dapo"]
    assert result["error"] is None, result["error"]
    for record in _steps(result):
        assert 1 <= record["dapo/rounds"] <= 3
        # the batch holds the step's 4 prompts: informative ones first, uniform fillers only if rounds ran out
        assert record["dapo/filler_groups"] == max(0, 4 - record["dapo/informative_groups"])
        assert record["dapo/rounds"] == 3 or record["dapo/informative_groups"] >= 4
        assert record["dapo/groups_generated"] == 4 * record["dapo/rounds"]
    assert any(r["actor/skipped_steps"] == 0 for r in _steps(result))


def test_dapo_all_uniform_batch_skips_the_update(matrix):
    """exact_match on a random model: every group's rewards are equal, every round; nothing to train on."""
    result = matrix["dapo_uniform"]
    assert result["error"] is None, result["error"]
    for record in _steps(result):
        assert record["dapo/informative_groups"] == 0 and record["dapo/rounds"] == 2
        assert record["dapo/filler_groups"] == 4 and record["actor/skipped_steps"] == 1
