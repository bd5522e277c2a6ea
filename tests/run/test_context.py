"""megarlhf.run.context: the model path errors a user meets first."""
import pytest

from megarlhf.run.context import load_tokenizer


def test_a_hub_name_as_model_path_says_so_and_a_local_typo_does_not(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"'Qwen/Qwen2.5-0.5B' is not an HF model directory .*hub name.*"
                                                r"megarlhf fetch"):
        load_tokenizer("Qwen/Qwen2.5-0.5B")
    (tmp_path / "runs").mkdir()
    for local in ("runs/x/hf", "runs/x", str(tmp_path / "nowhere")):
        with pytest.raises(FileNotFoundError, match=r"\(no config.json there\)$"):
            load_tokenizer(local)


def test_prompts_without_answers_are_refused_when_a_reward_scores_against_them():
    from megarlhf.config.reward import RewardConfig, RewardSpec
    from megarlhf.core.errors import DataError
    from megarlhf.data.prompts import PromptDataset, PromptExample
    from megarlhf.run.checks import check_ground_truths

    rows = [PromptExample(index=i, prompt="p", prompt_ids=[1], ground_truth=answer)
            for i, answer in enumerate(["5", None, None])]
    dataset = PromptDataset(rows, 0, "train.jsonl")
    for name in ("exact_match", "numeric", "math_verify"):
        rewards = RewardConfig(functions=[RewardSpec("test_context:length_reward"), RewardSpec(name)])
        with pytest.raises(DataError, match=rf"^train.jsonl: 2 of 3 prompts have no 'solution' field "
                                            rf"\(data.answer_key; first: row 1\), which the reward {name} scores"):
            check_ground_truths(dataset, rewards, "solution")
    # a function that does not declare it (a user's, a length reward) and no reward at all: accepted
    check_ground_truths(dataset, RewardConfig(functions=[RewardSpec("test_context:length_reward")]), "answer")
    check_ground_truths(dataset, None, "answer")
    check_ground_truths(PromptDataset(rows[:1], 0, "x"), RewardConfig(), "answer")


def length_reward(sample) -> float:  # a user's reward that needs no answer
    return float(len(sample.response))
