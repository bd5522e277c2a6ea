"""The ``data`` section (which files, which row keys) and the keys of preference rows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarlhf.core.errors import DataError


@dataclass
class DataConfig:
    """Which files hold the prompts / SFT examples and how their rows are read (the only place the
    data defaults live). A row provides either a prompt string (``prompt_key``) or chat messages
    (``messages_key``: a list of ``{"role", "content"}``); RL rows carry a ground truth
    (``answer_key``), SFT completion rows a response (``response_key``)."""

    train_path: str = ""  # JSONL/Parquet file or datasets directory; `train` and `sft` need it, `eval` does not
    eval_path: str | None = None
    split: str | None = None  # which split of a DatasetDict directory
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    response_key: str = "response"  # SFT completion rows
    messages_key: str | None = None  # set to read chat messages instead of a prompt string
    chat_template: Literal["auto", "always", "never"] = "auto"  # auto: when the tokenizer has one
    system_prompt: str | None = None  # prepended as a system message (chat) or text (plain)
    max_prompt_length: int = 1024  # prompts with more tokens are dropped (RL)
    max_sequence_length: int = 4096  # SFT examples with more tokens are dropped
    shuffle: bool = True

    def __post_init__(self):
        for name in ("max_prompt_length", "max_sequence_length"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0):
                raise DataError(f"DataConfig.{name} must be a positive int, got {value!r}")


@dataclass
class PreferenceDataConfig:
    """The keys of a preference row (the only place their defaults live)."""

    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    completion_key: str = "completion"  # unpaired rows (KTO)
    label_key: str = "label"  # unpaired rows: true (desirable) or false (undesirable)

    def __post_init__(self):
        names = ("prompt_key", "chosen_key", "rejected_key", "completion_key", "label_key")
        for name in names:
            value = getattr(self, name)
            if not (isinstance(value, str) and value):
                raise DataError(f"PreferenceDataConfig.{name} must be a non-empty string, got {value!r}")
        for group in (names[:3], (names[0], *names[3:])):
            keys = tuple(getattr(self, name) for name in group)
            if len(set(keys)) != 3:
                raise DataError(f"PreferenceDataConfig: {', '.join(group)} must be three different keys, got {keys}")
