"""The rows ``megarlhf rs`` and ``megarlhf online-dpo`` write read back, through ``megarlhf sft``'s and
``megarlhf dpo``'s own loaders, to the very tokens the round trained on: in chat mode (ChatML, the tiny
Qwen2 tokenizer's template, with a system prompt) and in plain mode. A sample cut off by the token
limit is neither kept nor chosen (it may be rejected), and is kept with ``iterative.keep_truncated``."""
import json
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from megarlhf.config import RunConfig, from_dict
from megarlhf.data.preference import load_preference_dataset
from megarlhf.data.prompts import build_prompt_dataset
from megarlhf.data.sft import load_sft_dataset
from megarlhf.config.data import DataConfig
from megarlhf.rollout.engines.sampling import RolloutBatch
from megarlhf.loops.collect import Collected
from megarlhf.core.errors import ConfigError
from megarlhf.loops.iterative import _odpo_round, _round as iterative_round, _rs_round, check_iterative_config
from model_providers.tiny_models import make_tiny_model

ROWS = [{"prompt": "What is 2 + 3?", "answer": "5"}, {"prompt": "What is 7 - 4?", "answer": "3"}]
# per prompt: three responses with rewards, and how each ended
RESPONSES = [("2 + 3 = 5. The answer is 5.", 1.0, "stop"), ("The answer is 6.", 0.0, "stop"),
             ("2 + 3 = 5. The answer", 1.0, "length"),
             ("7 - 4 = 3. The answer", 1.0, "length"), ("The answer is 2.", 0.0, "stop"),
             ("7 - 4 = 3. The answer is 3.", 1.0, "stop")]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The tiny Qwen2 tokenizer with <|im_end|> as its EOS, as in instruct models: chat rollouts stop on it."""
    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2")))
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


def _round(tok, chat: bool, rewards: dict | None = None, **iterative):
    data = DataConfig(train_path="-", chat_template="always" if chat else "never", system_prompt="Be brief.")
    prompts = build_prompt_dataset(ROWS, tok, data).examples
    rollout = RolloutBatch()
    for k, (text, reward, finish) in enumerate(RESPONSES):
        ids = tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if finish == "stop" else [])
        rollout.prompt_index.append(k // 3)
        rollout.prompt_ids.append(prompts[k // 3].prompt_ids)
        rollout.response_ids.append(ids)
        rollout.logprobs.append([0.0] * len(ids))
        rollout.finish_reasons.append(finish)
    got = Collected(prompts, rollout, [r for _, r, _ in RESPONSES], 0, None, {})
    config = from_dict(RunConfig, {"model": {"path": "x"}, "data": {"train_path": "x"}, "iterative": iterative,
                                   "reward": rewards or {}})
    return got, config


def _write(tmp_path, records):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "plain"])
def test_kept_samples_read_back_as_the_sft_examples_trained_on(tok, tmp_path, chat):
    got, config = _round(tok, chat)
    items, records, sums = _rs_round(got, config, tok, step=4)
    assert [r["reward"] for r in records] == [1.0, 1.0] and sums == [2, 6, 2, 2, 2.0]
    assert [r["finish_reason"] for r in records] == ["stop", "stop"]  # prompt 1's first best was cut off
    assert records[1]["response" if not chat else "messages"] != "7 - 4 = 3. The answer"
    data = DataConfig(train_path="-", chat_template="always" if chat else "never",
                      messages_key="messages" if chat else None)
    back = load_sft_dataset(_write(tmp_path, records), tok, data)
    for item, example in zip(items, back.examples, strict=True):
        if chat:  # the template writes "\n" after <|im_end|>, which SFT also trains on
            assert example.input_ids[:-1] == item.input_ids and example.loss_mask[:-1] == item.loss_mask
        else:
            assert (example.input_ids, example.loss_mask) == (item.input_ids, item.loss_mask)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "plain"])
def test_pairs_read_back_as_the_dpo_pairs_trained_on(tok, tmp_path, chat):
    got, config = _round(tok, chat)
    items, records, sums = _odpo_round(got, config, tok, step=2)
    # prompt 0: first best 0 vs worst 1; prompt 1: sample 3 is cut off, so 5 is chosen, against 4
    assert [(r["chosen_reward"], r["rejected_reward"]) for r in records] == [(1.0, 0.0), (1.0, 0.0)]
    assert sums == [2, 6, 2, 2, 2.0]
    back = load_preference_dataset(_write(tmp_path, records), tok,
                                   DataConfig(train_path="-", chat_template="always" if chat else "never"))
    for item, pair in zip(items, back.pairs, strict=True):
        assert (pair.prompt_len, pair.chosen_ids, pair.rejected_ids) == (item.prompt_len, item.chosen_ids,
                                                                        item.rejected_ids)
        assert (pair.chosen_mask, pair.rejected_mask) == (item.chosen_mask, item.rejected_mask)


def test_keep_truncated_keeps_the_cut_off_sample(tok):
    got, config = _round(tok, False, keep_truncated=True)
    items, records, _ = _rs_round(got, config, tok, step=0)
    assert [r["finish_reason"] for r in records] == ["stop", "length"]
    _, pairs, _ = _odpo_round(got, config, tok, step=0)
    assert [p["chosen"] for p in pairs] == ["2 + 3 = 5. The answer is 5.", "7 - 4 = 3. The answer"]


def test_an_episode_that_ended_in_an_error_is_never_kept(tok):
    got, config = _round(tok, False, keep_truncated=True)
    got.rollout.finish_reasons[0] = got.rollout.finish_reasons[2] = "error"  # prompt 0's two best samples
    _, records, _ = _rs_round(got, config, tok, step=0)
    assert [r["finish_reason"] for r in records] == ["length"]  # prompt 0 keeps nothing above the threshold


LEARNED = {"functions": [], "reward_model_path": "/models/rm"}


def test_a_learned_rewards_default_threshold_keeps_each_prompts_best(tok):
    got, config = _round(tok, False, rewards=LEARNED)
    got.rewards = [-1.5, -3.0, 0.2, -0.4, -2.0, -0.9]  # a reward model's scores: no 0.5 to reach
    _, records, _ = _rs_round(got, config, tok, step=0)
    assert [r["reward"] for r in records] == [-1.5, -0.9]  # each prompt's best not cut off
    got, config = _round(tok, False)  # a rule reward: the correct answers (>= 0.5) only
    got.rewards = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert _rs_round(got, config, tok, step=0)[1] == []
    with pytest.raises(ConfigError, match=r"rs_keep='threshold' with a learned reward \(reward\.reward_model_path\) "
                                          r"needs an explicit iterative\.rs_threshold"):
        check_iterative_config(_round(tok, False, rewards=LEARNED, rs_keep="threshold")[1], "rs")


def test_a_sample_whose_reward_failed_is_neither_kept_nor_paired(tok):
    got, config = _round(tok, False, rewards=LEARNED)
    got.rewards = [-1.0, -3.0, -2.0, -0.4, -2.5, -0.9]
    got.failed = [True, False, False, False, False, False]  # prompt 0's best: a NaN the reward replaced
    _, records, _ = _rs_round(got, config, tok, step=0)
    assert [r["reward"] for r in records] == [-3.0, -0.9]
    _, pairs, _ = _odpo_round(got, config, tok, step=0)
    assert [(p["chosen_reward"], p["rejected_reward"]) for p in pairs] == [(-0.9, -2.5)]  # prompt 0: no pair


def test_a_skipped_round_advances_the_learning_rate_schedule(tok):
    got, config = _round(tok, False, rs_threshold=2.0)  # nothing reaches it: the round trains on nothing
    config.train.epochs_per_step = 3
    steps = []
    runtime = SimpleNamespace(dp=SimpleNamespace(size=1, rank=0), all_reduce=lambda sums: sums,
                              all_gather_objects=lambda value, over: [value])
    scheduler = SimpleNamespace(step=lambda increment: steps.append(increment))
    run = SimpleNamespace(runtime=runtime, config=config, tokenizer=tok, actor=SimpleNamespace(scheduler=scheduler))
    metrics = iterative_round(run, "rs", got, 0, SimpleNamespace(write=lambda records: None))
    assert metrics["rs/skipped_updates"] == 1.0 and steps == [3]
