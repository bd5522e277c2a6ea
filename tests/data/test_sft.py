"""SFT ids + loss mask: the masked tokens are exactly the response tokens (chat and plain modes)."""
from __future__ import annotations

import pytest

from megarlhf.config.data import DataConfig
from megarlhf.data import build_sft_dataset, load_sft_dataset


def _masked(example):
    return [t for t, m in zip(example.input_ids, example.loss_mask) if m]


def test_chat_single_turn(tokenizer):
    row = {"prompt": "What is 2 + 3?", "response": "2 + 3 = 5. The answer is 5."}
    [example] = build_sft_dataset([row], tokenizer, DataConfig(train_path="-")).examples
    messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(example.input_ids) == full
    assert tokenizer.decode(_masked(example)) == row["response"] + "<|im_end|>\n"
    # the masked tokens are one contiguous run at the end, preceded by the generation prompt
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert example.loss_mask == [0] * n_prompt + [1] * (len(example.input_ids) - n_prompt)


def test_chat_multi_turn_masks_every_assistant_turn(tokenizer):
    row = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "a?"},
                        {"role": "assistant", "content": "first"}, {"role": "user", "content": "b?"},
                        {"role": "assistant", "content": "second"}]}
    [example] = build_sft_dataset([row], tokenizer, DataConfig(train_path="-", messages_key="messages")).examples
    assert tokenizer.decode(example.input_ids) == tokenizer.apply_chat_template(row["messages"], tokenize=False)
    runs, current = [], []
    for token, m in zip(example.input_ids, example.loss_mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs.append(current) if current else None
    assert [tokenizer.decode(r) for r in runs] == ["first<|im_end|>\n", "second<|im_end|>\n"]
    with pytest.raises(ValueError, match="no assistant message"):
        build_sft_dataset([{"messages": row["messages"][:2]}], tokenizer,
                          DataConfig(train_path="-", messages_key="messages"))


def test_plain_completion(plain_tokenizer, tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text('{"q": "What is 2 + 3?", "a": " The answer is 5."}\n')
    config = DataConfig(train_path=str(path), prompt_key="q", response_key="a")
    [example] = load_sft_dataset(str(path), plain_tokenizer, config).examples
    prompt_ids = plain_tokenizer("What is 2 + 3?")["input_ids"]
    response_ids = plain_tokenizer(" The answer is 5.", add_special_tokens=False)["input_ids"]
    assert example.input_ids == prompt_ids + response_ids + [plain_tokenizer.eos_token_id]
    assert example.loss_mask == [0] * len(prompt_ids) + [1] * (len(response_ids) + 1)


def test_length_filter(tokenizer):
    rows = [{"prompt": "short", "response": "ok"}, {"prompt": "long " * 200, "response": "ok"}]
    data = build_sft_dataset(rows, tokenizer, DataConfig(train_path="-", max_sequence_length=64))
    assert len(data) == 1 and data.num_dropped == 1


def test_inconsistent_template_rejected(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    # a template that drops earlier assistant turns (like some reasoning models' templates)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                         "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    with pytest.raises(ValueError, match="does not render message 3 as an extension"):
        build_sft_dataset([row], tok, DataConfig(train_path="-", messages_key="messages"))
