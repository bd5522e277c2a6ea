"""``megarlhf rs`` and ``megarlhf online-dpo`` end to end through the command line on 2 ranks (DP=2) with a
tiny model, the synthetic arithmetic prompts and a graded reward (a test-local function by dotted path,
so that samples of a prompt differ in reward): the rounds record their documented metrics, the kept
samples and pairs are written as rows ``megarlhf sft`` and ``megarlhf dpo`` read, and their numbers agree
with the rules of :mod:`megarlhf.algorithms.selection` applied to the logged rewards; a run killed after a
checkpoint and resumed matches the uninterrupted one bit for bit (metrics and the kept-data file)."""
import math
from pathlib import Path

import pytest

import megarlhf
from megarlhf.records.metrics import read_metrics
from megarlhf.testing.launch import run_torchrun

from _rl_recipe import kill_after_checkpoint, write_recipe

CLI = Path(megarlhf.__file__).with_name("__main__.py")
TIMING = ("time/", "weight_sync/bytes_per_s", "memory/")  # measured, not computed
REWARD_MODULE = '''
def digits(sample):
    """A graded reward: the number of digits in the response, in tenths (capped at 1)."""
    return min(sum(c.isdigit() for c in sample.response), 10) / 10
'''


def _setup(tmp_path: Path, rl_assets, name: str, *overrides: str) -> tuple[Path, list[str], dict]:
    (tmp_path / "graded_reward.py").write_text(REWARD_MODULE)
    run_dir = tmp_path / name
    recipe = write_recipe(tmp_path / f"{name}.yaml", rl_assets, "grpo", run_dir)
    common = ["reward.functions=[{name: 'graded_reward:digits'}]", "eval.reward_functions=[{name: exact_match}]",
              "train.steps=3", "checkpoint.every=1", "eval.every=3", "rollout.n_samples=3",
              "iterative.keep_truncated=true", *overrides]  # a random tiny model seldom ends within 12 tokens
    return run_dir, [str(recipe), *common], {"PYTHONPATH": str(tmp_path)}


def _run(command: str, tmp_path: Path, rl_assets, name: str, *overrides: str) -> Path:
    run_dir, args, env = _setup(tmp_path, rl_assets, name, *overrides)
    run_torchrun(CLI, 2, [command, *args], timeout_s=900, env=env)
    return run_dir


def _comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


def _rounds(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]


@pytest.mark.slow  # ~45 s on 2 cores (online DPO, the same driver, stays in the default suite): make test-slow
def test_rejection_sampling_run_keeps_the_best_and_writes_sft_rows(tmp_path, rl_assets):
    run_dir = _run("rs", tmp_path, rl_assets, "rs", "iterative.rs_threshold=0.1")
    rounds = _rounds(run_dir)
    assert [r["step"] for r in rounds] == [0, 1, 2]
    kept = read_metrics(run_dir / "rs_kept.jsonl")
    for r in rounds:
        mine = [row for row in kept if row["step"] == r["step"]]
        assert r["rs/kept"] == len(mine) <= 4  # at most the best of each of the 4 prompts
        assert r["rs/kept_fraction"] == len(mine) / 12
        if mine:  # the logged rows are the kept samples: each reached the threshold
            assert all(row["reward"] >= 0.1 for row in mine)
            assert r["rs/reward_kept"] == pytest.approx(sum(row["reward"] for row in mine) / len(mine))
            assert all(set(row) == {"step", "prompt", "response", "reward", "ground_truth", "finish_reason"}
                       for row in mine)
        assert ("sft/loss" in r) == (len(mine) >= 2) and r["rs/skipped_updates"] == float(len(mine) < 2)
    assert any("sft/loss" in r for r in rounds), "no round kept enough samples to train: the test proves nothing"
    from transformers import AutoTokenizer

    from megarlhf.data.sft import load_sft_dataset
    from megarlhf.config.data import DataConfig

    back = load_sft_dataset(str(run_dir / "rs_kept.jsonl"), AutoTokenizer.from_pretrained(rl_assets[0]),
                            DataConfig(train_path="-", chat_template="never"))
    assert len(back) == len(kept)  # megarlhf sft reads the rows (their tokens: tests/loops/test_iterative_rows.py)
    final = read_metrics(run_dir / "metrics.jsonl")[-1]
    assert final["step"] == 3 and "eval/accuracy" in final
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run_dir / "hf")


@pytest.mark.slow  # about 50 s: keeps the default suite under 15 minutes
def test_online_dpo_run_forms_pairs_from_the_rewards_and_writes_dpo_rows(tmp_path, rl_assets):
    run_dir = _run("online-dpo", tmp_path, rl_assets, "odpo", "iterative.pair_rule=all")
    rounds = _rounds(run_dir)
    pairs = read_metrics(run_dir / "online_pairs.jsonl")
    for r in rounds:
        mine = [row for row in pairs if row["step"] == r["step"]]
        assert r["odpo/pairs"] == len(mine)
        assert all(row["chosen_reward"] > row["rejected_reward"] and row["chosen"] != row["rejected"] for row in mine)
        if mine:
            gap = sum(row["chosen_reward"] - row["rejected_reward"] for row in mine) / len(mine)
            assert r["odpo/reward_gap"] == pytest.approx(gap)
        if len(mine) >= 2:
            assert 0 <= r["rewards/accuracy"] <= 1 and r["dpo/grad_norm"] > 0
    assert any("dpo/loss" in r for r in rounds), "no round formed enough pairs to train: the test proves nothing"
    first = next(r for r in rounds if "dpo/loss" in r)
    if first["step"] == 0:  # the policy is the fixed reference at round 0: log 2
        assert first["dpo/loss"] == pytest.approx(0.693147, abs=1e-5)


@pytest.mark.slow  # about 50 s: make test-slow
def test_online_dpo_with_a_refreshed_reference_starts_every_round_at_log_2(tmp_path, rl_assets):
    """iterative.reference=refresh: the reference is the policy as the round began, so each round's first
    step compares the policy with itself (every log-ratio 0): the DPO loss is log 2 whatever the pairs."""
    run_dir = _run("online-dpo", tmp_path, rl_assets, "refresh", "iterative.pair_rule=all",
                   "iterative.reference=refresh", "train.epochs_per_step=1")
    trained = [r for r in _rounds(run_dir) if "dpo/loss" in r]
    assert len(trained) >= 2, "fewer than two rounds trained: the test proves nothing"
    assert [r["dpo/loss"] for r in trained] == pytest.approx([math.log(2)] * len(trained), abs=1e-6)


@pytest.mark.slow  # three 2-rank runs of each mode and two kills (~4 min): make test-slow
@pytest.mark.parametrize("command, kept_file, overrides", [
    ("rs", "rs_kept.jsonl", ("iterative.rs_keep=threshold", "iterative.rs_threshold=0.1")),
    ("online-dpo", "online_pairs.jsonl", ("iterative.reference=refresh", "preference.loss=ipo"))])
def test_killed_and_resumed_round_run_matches_uninterrupted(tmp_path, rl_assets, command, kept_file, overrides):
    whole = _run(command, tmp_path, rl_assets, "whole", *overrides)
    cut, args, env = _setup(tmp_path, rl_assets, "cut", *overrides)
    kill_after_checkpoint(CLI, [command, *args], cut / "checkpoints" / "step_1", cut / "checkpoints" / "step_2",
                          env=env)
    run_torchrun(CLI, 2, [command, *args, "checkpoint.resume=auto"], timeout_s=900, env=env)
    resumed, uninterrupted = read_metrics(cut / "metrics.jsonl"), read_metrics(whole / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert _comparable(resumed) == _comparable(uninterrupted)
    assert read_metrics(cut / kept_file) == read_metrics(whole / kept_file)
    weights = [sorted(p.name for p in (run / "hf").glob("*.safetensors")) for run in (cut, whole)]
    assert weights[0] == weights[1] and weights[0]
    for name in weights[0]:  # the exported policies are the same bytes
        assert (cut / "hf" / name).read_bytes() == (whole / "hf" / name).read_bytes(), name


@pytest.mark.slow  # two 2-rank runs (~1.5 min): make test-slow
@pytest.mark.parametrize("command, layout", [("rs", "parallel.tensor_model_parallel_size=2"),
                                             ("online-dpo", "parallel.pipeline_model_parallel_size=2")])
def test_round_runs_at_tp2_and_pp2(tmp_path, rl_assets, command, layout):
    extra = ("iterative.rs_threshold=0.1",) if command == "rs" else ()
    run_dir = _run(command, tmp_path, rl_assets, "run", layout, "train.global_batch_size=2", *extra)
    rounds = _rounds(run_dir)
    assert [r["step"] for r in rounds] == [0, 1, 2]
    key = "sft/loss" if command == "rs" else "dpo/loss"
    trained = [r for r in rounds if key in r]
    assert trained and all(r[key] > 0 and r[f"{key.split('/')[0]}/grad_norm"] > 0 for r in trained)
