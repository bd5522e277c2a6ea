"""Prompt rendering with the tiny tokenizer's chat template, plain mode, field names, length filtering."""
from __future__ import annotations

import pytest

from megarlhf.data import DataConfig, build_prompt_dataset, load_prompt_dataset

ROWS = [{"question": "What is 2 + 3?", "gold": "5", "source": "hand"},
        {"question": "What is 4 * 4? " + "Think hard. " * 40, "gold": "16", "source": "hand"}]


def test_chat_template_applied(tokenizer):
    config = DataConfig(train_path="-", prompt_key="question", answer_key="gold", system_prompt="Be brief.")
    data = build_prompt_dataset(ROWS[:1], tokenizer, config)
    [example] = data.examples
    want = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert example.prompt == want
    assert example.prompt_ids == tokenizer(want, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(example.prompt_ids[:1]) == ["<|im_start|>"]
    assert example.ground_truth == "5" and example.metadata == {"source": "hand"}


def test_messages_field(tokenizer):
    rows = [{"msgs": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}], "answer": "x"}]
    config = DataConfig(train_path="-", messages_key="msgs", system_prompt="ignored: the row has one")
    [example] = build_prompt_dataset(rows, tokenizer, config).examples
    assert example.prompt == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match=r"row 0: field 'msgs' must be a non-empty list"):
        build_prompt_dataset([{"msgs": "Hi"}], tokenizer, config)


def test_plain_mode(tokenizer, plain_tokenizer):
    config = DataConfig(train_path="-", prompt_key="question", answer_key="gold")
    for tok, cfg in ((plain_tokenizer, config), (tokenizer, DataConfig(**{**vars(config), "chat_template": "never"}))):
        [example] = build_prompt_dataset(ROWS[:1], tok, cfg).examples
        assert example.prompt == "What is 2 + 3?"
        assert example.prompt_ids == tokenizer("What is 2 + 3?")["input_ids"]
    with pytest.raises(ValueError, match="'always' but the tokenizer has no chat template"):
        build_prompt_dataset(ROWS, plain_tokenizer, DataConfig(train_path="-", chat_template="always"))


def test_length_filter_reports_dropped(tokenizer, caplog):
    config = DataConfig(train_path="-", prompt_key="question", answer_key="gold", max_prompt_length=40)
    lengths = [len(tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}], tokenize=True,
                                                 add_generation_prompt=True, return_dict=True)["input_ids"])
               for r in ROWS]
    assert lengths[0] <= 40 < lengths[1]
    data = build_prompt_dataset(ROWS, tokenizer, config, source="rows.jsonl")
    assert [e.index for e in data.examples] == [0] and data.num_dropped == 1
    assert "rows.jsonl: dropped 1 of 2 prompts longer than data.max_prompt_length=40" in caplog.text
    with pytest.raises(ValueError, match="no prompt is left after filtering"):
        build_prompt_dataset(ROWS[1:], tokenizer, config)


def test_missing_field_named(tokenizer, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "q", "gold": "1"}\n{"prompt": "q"}\n')
    config = DataConfig(train_path=str(path), prompt_key="question")
    with pytest.raises(ValueError, match=r"d\.jsonl row 1: the row has no field 'question' \(data\.prompt_key\); "
                                         r"its fields: \['prompt'\]"):
        load_prompt_dataset(str(path), tokenizer, config)
