"""``megarlhf rm``, ``megarlhf dpo`` and RL against the learned reward, end to end through the command
line on 2 ranks with a tiny model and synthetic preference pairs whose ground truth is known.

Checks what a user relies on: the runs record their documented metrics, export HF directories that
transformers loads (the reward model as ...ForSequenceClassification with its score statistics); a
resumed DPO run continues exactly as the uninterrupted one; an RL run scores with the learned reward
(reward/mean is the weighted reward-model score) while evaluation keeps the task's verifier; bad reward
models are refused naming the path.
"""
import json
from pathlib import Path

import pytest

import megarlhf
from megarlhf.data.synthetic import write_preference_task
from megarlhf.records.metrics import read_metrics
from megarlhf.testing.launch import run_torchrun

from _rl_recipe import write_recipe

CLI = Path(megarlhf.__file__).with_name("__main__.py")
PAIRS_RECIPE = """
model: {{path: {model}, dtype: float32}}
data: {{train_path: {data}/pairs_train.jsonl, eval_path: {data}/pairs_heldout.jsonl, chat_template: never,
        max_sequence_length: 256}}
optim: {{lr: 1.0e-3}}
train: {{steps: 4, global_batch_size: 8, micro_batch_tokens: 512}}
eval: {{every: 2}}
checkpoint: {{every: 2}}
logging: {{run_dir: {run}, backends: []}}
"""


@pytest.fixture(scope="module")
def pairs(rl_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    write_preference_task(root, n_train=32, n_heldout=8, seed=0, max_steps=1)
    return rl_assets[0], root


def _pairs_run(command: str, pairs, run_dir: Path, *overrides: str) -> Path:
    model, data = pairs
    recipe = run_dir.parent / f"{run_dir.name}.yaml"
    recipe.write_text(PAIRS_RECIPE.format(model=model, data=data, run=run_dir))
    run_torchrun(CLI, 2, [command, str(recipe), *overrides], timeout_s=900)
    return run_dir


@pytest.fixture(scope="module")
def reward_model(pairs, tmp_path_factory):
    return _pairs_run("rm", pairs, tmp_path_factory.mktemp("rm") / "run")


def test_rm_run_records_metrics_and_exports_a_sequence_classifier(reward_model):
    from transformers import AutoModelForSequenceClassification

    records = read_metrics(reward_model / "metrics.jsonl")
    train = [r for r in records if "rm/loss" in r]
    assert [r["step"] for r in train] == [0, 1, 2, 3]
    assert all(0.0 <= r["rm/accuracy"] <= 1.0 and r["rm/grad_norm"] > 0 for r in train)
    assert [r["step"] for r in records if "eval/rm/accuracy" in r] == [0, 2, 4]
    model = AutoModelForSequenceClassification.from_pretrained(reward_model / "hf")
    assert model.config.num_labels == 1
    stats = json.loads((reward_model / "hf" / "megarlhf_reward_stats.json").read_text())
    assert stats["std"] > 0 and stats["responses"] == 64  # both sides of the 32 training pairs


@pytest.mark.slow  # two 2-rank DPO runs and a kill (~65 s): make test-slow
def test_dpo_resumed_run_continues_as_the_uninterrupted_one(pairs, tmp_path):
    whole = _pairs_run("dpo", pairs, tmp_path / "whole", "preference.precompute_reference=true")
    _pairs_run("dpo", pairs, tmp_path / "part", "preference.precompute_reference=true", "train.steps=2")
    _pairs_run("dpo", pairs, tmp_path / "part", "preference.precompute_reference=true", "checkpoint.resume=auto")
    a, b = (read_metrics(run / "metrics.jsonl") for run in (whole, tmp_path / "part"))
    after = {r["step"]: r for r in b if r["step"] >= 2 and "dpo/loss" in r}
    for record in (r for r in a if r["step"] >= 2 and "dpo/loss" in r):
        for key in ("dpo/loss", "dpo/grad_norm", "rewards/margin", "logps/chosen"):
            assert after[record["step"]][key] == record[key], (record["step"], key)
    step0 = next(r for r in a if r["step"] == 0 and "dpo/loss" in r)
    assert step0["dpo/loss"] == pytest.approx(0.693147, abs=1e-5)  # policy == reference at step 0
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(whole / "hf")


@pytest.mark.slow  # ~45 s each (CI runs the slow set); the reward-model slot is unit-tested in tests/rewards
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_rl_against_the_learned_reward(rl_assets, reward_model, tmp_path, estimator):
    recipe = write_recipe(tmp_path / "recipe.yaml", rl_assets, estimator, tmp_path / "run")
    run_torchrun(CLI, 2, ["train", str(recipe), "reward.functions=[]",
                          f"reward.reward_model_path={reward_model / 'hf'}", "reward.reward_model_weight=0.5",
                          "reward.reward_model_normalize=true", "eval.reward_functions=[{name: exact_match}]"],
                 timeout_s=900)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records[:2]:
        assert record["reward/mean"] == pytest.approx(0.5 * record["reward/reward_model/mean"], rel=1e-9, abs=1e-12)
        assert record["reward/std"] > 0  # a learned score, not a 0/1 verifier
        assert "reward/exact_match/mean" not in record
    assert records[0]["mismatch/step0_logprob_gap_max"] < 1e-4
    assert records[2]["eval/accuracy"] in {i / 4 for i in range(5)}  # the verifier's 0/1 on 4 prompts x 1


def test_reward_model_refusals_name_the_path(rl_assets, tmp_path):
    from megarlhf.config import RunConfig, from_dict
    from megarlhf.learner.learned_reward import check_reward_model
    from megarlhf.learner import build_reward_model
    from model_providers.tiny_models import make_tiny_model, train_tiny_tokenizer
    from transformers import AutoTokenizer

    model = rl_assets[0]
    config = from_dict(RunConfig, {"model": {"path": str(model)}})
    with pytest.raises(ValueError, match=f"reward model {model}: no score.weight"):
        build_reward_model(config, None, str(model), trainable=False)
    other = make_tiny_model("qwen2", tmp_path / "other", seed=0)
    train_tiny_tokenizer(vocab_size=300).save_pretrained(other)
    with pytest.raises(ValueError, match=f"reward_model_path='{other}': its vocabulary differs"):
        check_reward_model(str(other), AutoTokenizer.from_pretrained(model))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        check_reward_model(str(tmp_path), AutoTokenizer.from_pretrained(model))
    with pytest.raises(ValueError, match="eval.reward_functions"):
        from_dict(RunConfig, {"model": {"path": "m"}, "eval": {"every": 1},
                              "reward": {"functions": [], "reward_model_path": "rm"}})


def _unpaired(source: Path, out: Path) -> None:
    """The pairs as unpaired KTO rows: each chosen response desirable, each rejected one undesirable."""
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    unpaired = [{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
                for r in rows for side in ("chosen", "rejected")]
    out.write_text("".join(json.dumps(r) + "\n" for r in unpaired))


@pytest.mark.slow  # three 2-rank KTO runs and a kill (~70 s): make test-slow
def test_kto_run_at_dp2_resumes_as_the_uninterrupted_one(pairs, tmp_path):
    model, data = pairs
    kto_data = tmp_path / "kto"
    kto_data.mkdir()
    for split in ("train", "heldout"):
        _unpaired(data / f"pairs_{split}.jsonl", kto_data / f"pairs_{split}.jsonl")
    kto = ("preference.loss=kto", "preference.params.undesirable_weight=1.2")
    whole = _pairs_run("dpo", (model, kto_data), tmp_path / "whole", *kto)
    _pairs_run("dpo", (model, kto_data), tmp_path / "part", *kto, "train.steps=2")
    _pairs_run("dpo", (model, kto_data), tmp_path / "part", *kto, "checkpoint.resume=auto")
    a, b = (read_metrics(run / "metrics.jsonl") for run in (whole, tmp_path / "part"))
    train = [r for r in a if "dpo/loss" in r]
    assert [r["step"] for r in train] == [0, 1, 2, 3]
    # policy == reference at step 0: the baseline is 0, up to the rounding of fp32 sums of ~-30 log-probs,
    # whose ulp is 3.8e-6 (the policy and the reference pass their rows in different micro-batches, and some
    # CPUs' GEMM kernels round by shape: 3.8e-6 on this round's AMD EPYC, before and after the refactor)
    assert abs(train[0]["kto/kl"]) <= 8e-6
    # ... so every row's loss is its weight times 1 - sigmoid(0) = 0.5: k desirable rows of the 8 give
    desirable = [k for k in range(9) if abs(train[0]["dpo/loss"] - 0.5 * (k + 1.2 * (8 - k)) / 8) < 1e-5]
    assert len(desirable) == 1 and 0 < desirable[0] < 8
    evals = [r for r in a if "eval/rewards/chosen" in r]
    assert [r["step"] for r in evals] == [0, 2, 4] and all("eval/kto/kl" in r for r in evals)
    assert evals[-1]["eval/dpo/loss"] < evals[0]["eval/dpo/loss"]  # the held-out KTO loss falls
    after = {r["step"]: r for r in b if r["step"] >= 2 and "dpo/loss" in r}
    for record in (r for r in train if r["step"] >= 2):
        for key in ("dpo/loss", "dpo/grad_norm", "rewards/chosen", "rewards/rejected", "kto/kl"):
            assert after[record["step"]][key] == record[key], (record["step"], key)


@pytest.mark.slow  # ~40 s (CI runs the slow set)
def test_rejection_sampling_keeps_the_samples_the_learned_reward_ranks_best(rl_assets, reward_model, tmp_path):
    recipe = write_recipe(tmp_path / "recipe.yaml", rl_assets, "grpo", tmp_path / "run")
    run_torchrun(CLI, 2, ["rs", str(recipe), "reward.functions=[]", f"reward.reward_model_path={reward_model / 'hf'}",
                          "eval.reward_functions=[{name: exact_match}]", "iterative.rs_threshold=null",
                          "iterative.keep_truncated=true", "rollout.n_samples=3"], timeout_s=900)
    rounds = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    kept = read_metrics(tmp_path / "run" / "rs_kept.jsonl")
    for record in rounds:  # every prompt keeps its best sample by the learned score
        mine = [row["reward"] for row in kept if row["step"] == record["step"]]
        assert len(mine) == 4 and record["rs/kept"] == 4 and "sft/loss" in record
        assert record["rs/reward_kept"] == pytest.approx(sum(mine) / 4)
        assert record["rs/reward_kept"] >= record["reward/mean"]  # the best of each group beats the mean
    assert any(r not in (0.0, 1.0) for r in (row["reward"] for row in kept))  # learned scores, not a verifier's
