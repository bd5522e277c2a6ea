"""Prompt rendering with the tiny tokenizer's chat template, plain mode, field names, length filtering."""
from __future__ import annotations

import pytest

from megarlhf.config.data import DataConfig
from megarlhf.data import build_prompt_dataset, load_prompt_dataset
from model_providers.tiny_models import TOOLS_CHAT_TEMPLATE

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


def test_an_environment_is_made_from_the_rows_fields_and_its_answer(tokenizer):
    seen = []
    config = DataConfig(train_path="-", prompt_key="question", answer_key="gold")
    [example] = build_prompt_dataset(ROWS[:1], tokenizer, config, describe_tools=lambda m: seen.append(m) or
                                     _describe(m)).examples
    assert seen == [example.episode_fields] == [{"ground_truth": "5", "source": "hand"}]  # at load as in rollouts
    rows = [{"question": "q", "gold": "5", "ground_truth": "the row's own"}]
    assert build_prompt_dataset(rows, tokenizer, config).examples[0].episode_fields["ground_truth"] == "the row's own"


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


SCHEMA = {"type": "function", "function": {"name": "add", "description": "adds two numbers",
                                           "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}}}


def _describe(metadata):
    from megarlhf.data.prompts import ToolDescription

    return ToolDescription([SCHEMA], f"TOOLS: add ({metadata['source']})")


def test_tools_rendered_by_a_template_that_takes_them(tokenizer):
    import copy

    from megarlhf.data.prompts import template_renders_tools

    tools_tokenizer = copy.deepcopy(tokenizer)
    tools_tokenizer.chat_template = TOOLS_CHAT_TEMPLATE
    assert template_renders_tools(tools_tokenizer) and not template_renders_tools(tokenizer)
    config = DataConfig(train_path="-", prompt_key="question", answer_key="gold", system_prompt="Be brief.")
    [example] = build_prompt_dataset(ROWS[:1], tools_tokenizer, config, describe_tools=_describe).examples
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    assert example.prompt == tools_tokenizer.apply_chat_template(messages, tools=[SCHEMA], tokenize=False,
                                                                 add_generation_prompt=True)
    assert example.prompt.startswith('<|im_start|>system\nBe brief.\n\n# Tools\n<tools>{"type": "function"')
    assert example.messages == messages and example.tools == [SCHEMA] and "TOOLS:" not in example.prompt


def test_tools_described_in_text_where_the_template_ignores_them(tokenizer, plain_tokenizer):
    config = DataConfig(train_path="-", prompt_key="question", answer_key="gold")
    [example] = build_prompt_dataset(ROWS[:1], tokenizer, config, describe_tools=_describe).examples
    assert example.prompt.startswith("<|im_start|>system\nTOOLS: add (hand)<|im_end|>\n<|im_start|>user\n")
    assert example.tools == [SCHEMA] and example.messages[0] == {"role": "system", "content": "TOOLS: add (hand)"}
    briefed = DataConfig(train_path="-", prompt_key="question", answer_key="gold", system_prompt="Be brief.")
    [example] = build_prompt_dataset(ROWS[:1], tokenizer, briefed, describe_tools=_describe).examples
    assert example.prompt.startswith("<|im_start|>system\nBe brief.\n\nTOOLS: add (hand)<|im_end|>\n")
    plain = DataConfig(train_path="-", prompt_key="question", answer_key="gold", chat_template="never")
    [example] = build_prompt_dataset(ROWS[:1], plain_tokenizer, plain, describe_tools=_describe).examples
    assert example.prompt == "TOOLS: add (hand)\n\nWhat is 2 + 3?" and example.messages is None


def test_a_failing_tool_description_names_the_row(tokenizer):
    def broken(metadata):
        raise KeyError("table")

    with pytest.raises(ValueError, match=r"rows\.jsonl row 0: the environment could not describe its tools: "
                                         r"KeyError: 'table'"):
        build_prompt_dataset(ROWS[:1], tokenizer, DataConfig(train_path="-", prompt_key="question"),
                             source="rows.jsonl", describe_tools=broken)
