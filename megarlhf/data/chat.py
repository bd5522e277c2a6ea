"""Conversations to token ids with a loss mask on the assistant's turns: the one chat rendering that SFT
examples (:mod:`megarlhf.data.sft`) and preference pairs (:mod:`megarlhf.data.preference`) share.
"""
from __future__ import annotations

from megarlhf.core.errors import DataError


def encode_text(tokenizer, text: str, special: bool = False) -> list[int]:
    """``text``'s token ids (with the tokenizer's special tokens, e.g. BOS, when ``special``); [] for ''."""
    return list(tokenizer(text, add_special_tokens=special)["input_ids"]) if text else []


def response_with_eos(tokenizer, text: str, where: str) -> list[int]:
    """A plain-mode response's token ids: the text, then the tokenizer's end of sequence (which the model must
    learn to write)."""
    if tokenizer.eos_token_id is None:
        raise DataError(f"{where}: a plain-mode response ends with EOS, but the tokenizer has no eos token")
    return encode_text(tokenizer, text) + [tokenizer.eos_token_id]


def render_with_loss_mask(messages: list[dict], tokenizer, first: int, where: str) -> tuple[list[int], list[int]]:
    """(ids, mask) of ``messages`` rendered with the chat template, the mask 1 exactly on the tokens of the
    assistant messages from index ``first`` on (their content and end-of-turn tokens, not the template's
    generation prompt before them). Each such message must render as an extension of the conversation
    before it, or its tokens cannot be told apart; ``where`` names the row in the errors."""
    segments: list[tuple[str, int]] = []  # (text, 1 if it carries loss)
    done = ""
    for i in range(first, len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        after = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not (before.startswith(done) and after.startswith(before)):
            raise DataError(f"{where}: the chat template does not render message {i} as an extension of the "
                            f"conversation before it, so response tokens cannot be masked exactly; "
                            f"use plain-text rows with data.chat_template=never")
        segments += [(before[len(done):], 0), (after[len(before):], 1)]
        done = after
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    if not full.startswith(done):
        raise DataError(f"{where}: the chat template renders the whole conversation differently from its prefixes")
    segments.append((full[len(done):], 0))
    ids, mask = [], []
    for text, label in segments:
        tokens = encode_text(tokenizer, text)
        ids += tokens
        mask += [label] * len(tokens)
    return ids, mask
