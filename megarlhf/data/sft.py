"""SFT examples: chat conversations or prompt/response rows -> token ids + a loss mask on response tokens.

Chat mode (a chat template is used, see ``prompts.uses_chat_template``): the conversation is the row's
messages (``data.messages_key``) or ``[system?, user: prompt, assistant: response]``. The template is
rendered for growing prefixes of the conversation; each assistant message's tokens are the text between
``template(messages[:i], add_generation_prompt=True)`` and ``template(messages[:i + 1])`` (its content and
end-of-turn marker), and only those carry loss. Every segment is tokenized on its own so the mask is
exact at the boundaries (:func:`megarlhf.data.chat.render_with_loss_mask`, which preference pairs use
too); a template that does not render prefixes consistently (one that rewrites earlier turns) is
rejected with a message.

Plain mode: ``prompt`` (after the system prompt) tokenized with the tokenizer's special tokens, then the
``response`` plus EOS, which carry the loss. Examples longer than ``data.max_sequence_length`` tokens are
dropped and counted.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from megarlhf.data.chat import encode_text, render_with_loss_mask, response_with_eos
from megarlhf.data.prompts import text_field, row_messages, uses_chat_template
from megarlhf.config.data import DataConfig
from megarlhf.data.source import read_records
from megarlhf.core.errors import DataError

logger = logging.getLogger(__name__)


@dataclass
class SFTExample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on response tokens, 0 elsewhere


@dataclass
class SFTDataset:
    examples: list[SFTExample]
    num_dropped: int  # examples longer than data.max_sequence_length
    source: str

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> SFTExample:
        return self.examples[i]


def _chat_example(messages: list[dict], tokenizer, where: str) -> SFTExample:
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant message to train on")
    return SFTExample(*render_with_loss_mask(messages, tokenizer, 0, where))


def _plain_example(row: dict, tokenizer, config: DataConfig, where: str) -> SFTExample:
    prompt = text_field(row, config.prompt_key, "prompt_key", where)
    response = text_field(row, config.response_key, "response_key", where)
    if config.system_prompt is not None:
        prompt = f"{config.system_prompt}\n\n{prompt}"
    prompt_ids = encode_text(tokenizer, prompt, special=True)
    response_ids = response_with_eos(tokenizer, response, where)
    return SFTExample(prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids))


def sft_example(row: dict, tokenizer, config: DataConfig, chat: bool, where: str) -> SFTExample:
    """One row -> ids + loss mask (see the module docstring)."""
    if not chat:
        if config.messages_key is not None:
            raise DataError(f"{where}: data.messages_key is set but no chat template is used")
        return _plain_example(row, tokenizer, config, where)
    if config.messages_key is not None:
        messages = row_messages(row, config, where)
    else:
        response = text_field(row, config.response_key, "response_key", where)
        messages = row_messages(row, config, where) + [{"role": "assistant", "content": response}]
    return _chat_example(messages, tokenizer, where)


def build_sft_dataset(rows: list[dict], tokenizer, config: DataConfig, source: str = "<rows>") -> SFTDataset:
    chat = uses_chat_template(tokenizer, config)
    examples = [sft_example(row, tokenizer, config, chat, f"{source} row {i}") for i, row in enumerate(rows)]
    kept = [e for e in examples if len(e.input_ids) <= config.max_sequence_length]
    dropped = len(examples) - len(kept)
    if dropped:
        logger.warning("%s: dropped %d of %d SFT examples longer than data.max_sequence_length=%d tokens",
                       source, dropped, len(examples), config.max_sequence_length)
    if not kept:
        raise DataError(f"{source}: no SFT example is left after filtering ({len(rows)} rows)")
    return SFTDataset(kept, dropped, source)


def load_sft_dataset(path: str, tokenizer, config: DataConfig) -> SFTDataset:
    return build_sft_dataset(read_records(path, config.split), tokenizer, config, source=str(path))
