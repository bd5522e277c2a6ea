"""RL prompt datasets: rows -> rendered prompt text + token ids + ground truth, with length filtering.

A row gives its prompt as a string (``data.prompt_key``) or as chat messages (``data.messages_key``).
With a chat template (``data.chat_template``: ``auto`` uses the tokenizer's template when it has one,
``always`` requires it, ``never`` is plain completion) the prompt is rendered with the tokenizer's
``apply_chat_template(..., add_generation_prompt=True)``; in plain mode the prompt text is used as is
(after ``data.system_prompt`` and a blank line, if set). Prompts longer than
``data.max_prompt_length`` tokens are dropped, and the number dropped is logged and kept.

Hand-written because this is the project's own glue between its data settings and the tokenizer.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from megarlhf.data.source import DataConfig, read_records
from megarlhf.errors import DataError

logger = logging.getLogger(__name__)


@dataclass
class PromptExample:
    index: int  # row number in the source file (0-based)
    prompt: str  # the text the model is given (template applied)
    prompt_ids: list[int]
    ground_truth: Any  # the row's answer field, None if absent
    metadata: dict[str, Any] = field(default_factory=dict)  # the row's other fields
    messages: list[dict[str, str]] | None = None  # chat mode: the messages the prompt renders (None: plain)


@dataclass
class PromptDataset:
    examples: list[PromptExample]
    num_dropped: int  # rows whose prompt exceeded data.max_prompt_length
    source: str

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> PromptExample:
        return self.examples[i]


def uses_chat_template(tokenizer, config: DataConfig) -> bool:
    """Whether prompts are rendered with the tokenizer's chat template (see the module docstring)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if config.chat_template == "always" and not has_template:
        raise DataError("data.chat_template is 'always' but the tokenizer has no chat template")
    return has_template and config.chat_template != "never"


def row_messages(row: dict, config: DataConfig, where: str) -> list[dict[str, str]]:
    """The row's chat messages (``messages_key``) or its prompt as one user message, after the system
    prompt if one is configured and the row has none."""
    if config.messages_key is not None:
        messages = _field(row, config.messages_key, "messages_key", where)
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise DataError(f"{where}: field {config.messages_key!r} must be a non-empty list of "
                            f"{{'role': str, 'content': str}} messages")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    else:
        messages = [{"role": "user", "content": text_field(row, config.prompt_key, "prompt_key", where)}]
    if config.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": config.system_prompt})
    return messages


def _field(row: dict, key: str, setting: str, where: str) -> Any:
    if key not in row:
        raise DataError(f"{where}: the row has no field {key!r} (data.{setting}); its fields: {sorted(row)}")
    return row[key]


def text_field(row: dict, key: str, setting: str, where: str) -> str:
    value = _field(row, key, setting, where)
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} (data.{setting}) must be a string, got {type(value).__name__}")
    return value


def render_prompt(row: dict, tokenizer, config: DataConfig, chat: bool, where: str) -> str:
    """The prompt text of one row (chat template with a generation prompt, or plain text)."""
    if chat:
        return tokenizer.apply_chat_template(row_messages(row, config, where), tokenize=False,
                                             add_generation_prompt=True)
    if config.messages_key is not None:
        raise DataError(f"{where}: data.messages_key is set but prompts are plain text (data.chat_template="
                        f"{config.chat_template!r}, tokenizer template: "
                        f"{'yes' if getattr(tokenizer, 'chat_template', None) else 'none'})")
    text = text_field(row, config.prompt_key, "prompt_key", where)
    return text if config.system_prompt is None else f"{config.system_prompt}\n\n{text}"


def build_prompt_dataset(rows: list[dict], tokenizer, config: DataConfig, source: str = "<rows>") -> PromptDataset:
    """Renders, tokenizes and length-filters ``rows`` (see the module docstring)."""
    chat = uses_chat_template(tokenizer, config)
    texts = [render_prompt(row, tokenizer, config, chat, f"{source} row {i}") for i, row in enumerate(rows)]
    messages = [row_messages(row, config, f"{source} row {i}") if chat else None for i, row in enumerate(rows)]
    # a chat template writes its own special tokens; plain text gets the tokenizer's usual ones (BOS)
    ids = tokenizer(texts, add_special_tokens=not chat)["input_ids"] if texts else []
    skip = {config.prompt_key, config.answer_key, config.messages_key}
    examples = [PromptExample(i, text, list(tokens), row.get(config.answer_key),
                              {k: v for k, v in row.items() if k not in skip}, messages[i])
                for i, (row, text, tokens) in enumerate(zip(rows, texts, ids))
                if len(tokens) <= config.max_prompt_length]
    dropped = len(rows) - len(examples)
    if dropped:
        logger.warning("%s: dropped %d of %d prompts longer than data.max_prompt_length=%d tokens",
                       source, dropped, len(rows), config.max_prompt_length)
    if not examples:
        raise DataError(f"{source}: no prompt is left after filtering ({len(rows)} rows, "
                        f"data.max_prompt_length={config.max_prompt_length})")
    if all(e.ground_truth is None for e in examples):
        logger.warning("%s: no row has the answer field %r (data.answer_key); ground truths are None",
                       source, config.answer_key)
    return PromptDataset(examples, dropped, source)


def load_prompt_dataset(path: str, tokenizer, config: DataConfig) -> PromptDataset:
    """The prompts of a local JSONL / Parquet / ``save_to_disk`` source."""
    return build_prompt_dataset(read_records(path, config.split), tokenizer, config, source=str(path))
