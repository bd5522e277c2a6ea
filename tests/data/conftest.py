"""The tiny locally trained tokenizer (with a ChatML template), built once for the data tests."""
from __future__ import annotations

import copy

import pytest

from model_providers.tiny_models import train_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return train_tiny_tokenizer()


@pytest.fixture(scope="session")
def plain_tokenizer(tokenizer):
    """The same tokenizer without a chat template."""
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    return plain
