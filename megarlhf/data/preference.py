"""Preference pairs: rows holding a prompt, a chosen and a rejected response -> the token ids of prompt +
response for each side, with a 0/1 loss mask on the response tokens (DPO-style training, reward models);
and unpaired rows for the unpaired losses (KTO): a prompt, one completion and a boolean label.

Sources are those of :func:`megarlhf.data.source.read_records` (JSONL, Parquet, ``save_to_disk``). The
row keys are :class:`PreferenceDataConfig`'s; of :class:`DataConfig` only ``split``, ``chat_template``,
``system_prompt`` and ``max_sequence_length`` are read (its key fields belong to RL and SFT rows).

* ``prompt``: a string, or (chat mode only) a list of ``{"role", "content"}`` messages.
* ``chosen`` / ``rejected``: a string (the response), or (chat mode only) a message list: either the
  turns that follow the prompt (it starts with an assistant message) or the whole conversation, which
  must then begin with the prompt's messages. Either way the response must start and end with an
  assistant message.

Chat mode (``prompts.uses_chat_template``): the conversation is the prompt's messages (after
``data.system_prompt``, as for RL prompts) followed by the response's. As for SFT (``chat.py``), the template
is rendered for growing prefixes and every segment is tokenized on its own, so the mask is exact at the
boundaries; here only the assistant messages of the response carry loss (their content and
end-of-turn marker), not assistant turns inside a multi-turn prompt. Where the tokenizer's EOS token
closes the last assistant message, the side ends there (what a rollout ends with; see ``_chat_side``).
The prompt's tokens (the template of the prompt with a generation prompt) are the same on both sides:
``prompt_len``.

Plain mode: the prompt (after ``data.system_prompt`` and a blank line) with the tokenizer's special
tokens, then the response plus EOS, which carry the loss (``sft.py``'s plain mode).

A pair is dropped, and counted in ``num_dropped``, when either side has more than
``data.max_sequence_length`` tokens: the two sides are kept or dropped together. Errors name the row
(``file:line`` for JSONL, ``file row N`` otherwise, both 1-based) and the key. A pair whose two sides
give the same tokens is refused: it carries no preference.

Unpaired rows (``prompt_key``, ``completion_key``, ``label_key``: TRL's unpaired preference format) are
encoded as one side of a pair is; the label must be a JSON boolean (``true``: desirable). Each
:class:`UnpairedExample` also carries its *KL row*: its own prompt followed by the completion of the
nearest row before it whose prompt differs (cyclically: the first row looks from the last), the
mismatched pairs from which KTO estimates its KL baseline, cut to ``data.max_sequence_length``. TRL
shifts completions by one row; skipping rows of the same prompt keeps a pair split into a desirable and
an undesirable row side by side (the usual way pairs are unpaired) from pairing a prompt with its own
other answer. Rows longer than the limit are dropped before the KL rows are formed; at least two rows
with different prompts must remain.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarlhf.data.prompts import uses_chat_template
from megarlhf.data.chat import encode_text, render_with_loss_mask
from megarlhf.config.data import DataConfig
from megarlhf.data.source import read_records
from megarlhf.core.errors import DataError
from megarlhf.config.data import PreferenceDataConfig

logger = logging.getLogger(__name__)


@dataclass
class PreferencePair:
    index: int  # row number in the source (0-based)
    prompt_len: int  # tokens of the prompt: the first prompt_len ids of both sides
    chosen_ids: list[int]  # prompt + chosen response
    chosen_mask: list[int]  # 1 on the response tokens that carry loss (token-aligned with chosen_ids)
    rejected_ids: list[int]
    rejected_mask: list[int]

    def rows(self) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
        """The two training rows (ids, mask): chosen, then rejected."""
        return (self.chosen_ids, self.chosen_mask), (self.rejected_ids, self.rejected_mask)


@dataclass
class UnpairedExample:
    index: int  # row number in the source (0-based)
    prompt_len: int
    ids: list[int]  # prompt + completion
    mask: list[int]  # 1 on the completion tokens that carry loss
    desirable: bool
    kl_ids: list[int]  # this prompt + another prompt's completion: KTO's KL-baseline row (module docstring)
    kl_mask: list[int]

    def rows(self) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
        """The two rows (ids, mask) the trainer reads: the example, then its KL row."""
        return (self.ids, self.mask), (self.kl_ids, self.kl_mask)


@dataclass
class PreferenceDataset:
    pairs: list[PreferencePair] | list[UnpairedExample]  # each item gives two rows (``rows()``)
    num_dropped: int  # items with a row longer than data.max_sequence_length
    source: str

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> PreferencePair:
        return self.pairs[i]


def _get(row: dict, key: str, setting: str, where: str) -> Any:
    if key not in row:
        raise DataError(f"{where}: the row has no field {key!r} ({setting}); its fields: {sorted(row)}")
    return row[key]


def _check_type(value: Any, key: str, setting: str, where: str, chat: bool) -> None:
    """Strings anywhere, message lists in chat mode only; anything else is an error naming the key."""
    if isinstance(value, str):
        return
    if not isinstance(value, list):
        raise DataError(f"{where}: field {key!r} ({setting}) must be a string or a list of chat messages, "
                        f"got {type(value).__name__}")
    if not chat:
        raise DataError(f"{where}: field {key!r} ({setting}) is a list of chat messages, but no chat template "
                        f"is used (data.chat_template or a tokenizer without one): give it as a string")
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise DataError(f"{where}: field {key!r} ({setting}): message {i} is not a "
                            f"{{'role': str, 'content': str}} message: {message!r}")


def _as_messages(value: str | list, role: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _response_messages(value: str | list, prompt: list[dict], key: str, setting: str,
                       where: str) -> list[dict[str, str]]:
    """The messages of a response given as a string, as the turns after the prompt or as the whole
    conversation (which must then begin with the prompt's messages)."""
    messages = _as_messages(value, "assistant")
    if messages and messages[0]["role"] != "assistant":
        if messages[:len(prompt)] != prompt:
            raise DataError(f"{where}: field {key!r} ({setting}) is a conversation that does not begin with the "
                            f"prompt's messages; give the whole conversation or only the turns after the prompt")
        messages = messages[len(prompt):]
    if not any(m["content"].strip() for m in messages if m["role"] == "assistant"):
        raise DataError(f"{where}: field {key!r} ({setting}) is an empty response")
    if messages[0]["role"] != "assistant" or messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: field {key!r} ({setting}): the response must start and end with an "
                        f"assistant message, got roles {[m['role'] for m in messages]}")
    return messages


def _chat_side(prompt: list[dict], response: list[dict], tokenizer, key: str,
               where: str) -> tuple[list[int], list[int]]:
    """(ids, mask) of ``prompt + response`` rendered with the chat template; only the response's
    assistant messages carry loss (see the module docstring). The side ends at the EOS token that closes
    its last assistant message, where the template writes one there (ChatML's ``<|im_end|>`` in instruct
    tokenizers): a rollout stops on that token, so a reward model trained on these pairs is read in RL
    at the token it was trained at, not at the newline the template writes after it."""
    ids, mask = render_with_loss_mask(prompt + response, tokenizer, len(prompt), f"{where}: field {key!r}")
    eos = tokenizer.eos_token_id
    ends = [i for i, (token, loss) in enumerate(zip(ids, mask)) if loss and token == eos]
    return (ids[:ends[-1] + 1], mask[:ends[-1] + 1]) if ends else (ids, mask)


def _prompt_messages(value: str | list, data: DataConfig, key: str, where: str) -> tuple[list, list]:
    """(the prompt's messages as the row gives them, the same after data.system_prompt)."""
    raw = _as_messages(value, "user")
    if not raw or not any(m["content"].strip() for m in raw):
        raise DataError(f"{where}: field {key!r} (prompt_key) is an empty prompt")
    messages = list(raw)
    if data.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": data.system_prompt})
    return raw, messages


def _plain_side(prompt_ids: list[int], response: str, tokenizer, key: str, setting: str,
                where: str) -> tuple[list[int], list[int]]:
    if not response.strip():
        raise DataError(f"{where}: field {key!r} ({setting}) is an empty response")
    response_ids = encode_text(tokenizer, response) + [tokenizer.eos_token_id]
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


def _encode_sides(row: dict, tokenizer, data: DataConfig, keys: PreferenceDataConfig, chat: bool, where: str,
                  responses: tuple[str, ...]) -> tuple[int, dict[str, tuple[list[int], list[int]]]]:
    """(prompt tokens, {setting: (ids, mask)}) of the row's prompt followed by each response named by a
    setting of ``responses`` (e.g. ``chosen_key``), encoded as the module docstring says."""
    fields = {}
    for setting in ("prompt_key", *responses):
        key = getattr(keys, setting)
        fields[setting] = _get(row, key, setting, where)
        _check_type(fields[setting], key, setting, where, chat)
    sides = {}
    if chat:
        raw, prompt = _prompt_messages(fields["prompt_key"], data, keys.prompt_key, where)
        for setting in responses:
            key = getattr(keys, setting)
            response = _response_messages(fields[setting], raw, key, setting, where)
            sides[setting] = _chat_side(prompt, response, tokenizer, key, where)
        prompt_len = len(encode_text(tokenizer, tokenizer.apply_chat_template(prompt, tokenize=False,
                                                                          add_generation_prompt=True)))
        return prompt_len, sides
    text = fields["prompt_key"]
    if not text.strip():
        raise DataError(f"{where}: field {keys.prompt_key!r} (prompt_key) is an empty prompt")
    if data.system_prompt is not None:
        text = f"{data.system_prompt}\n\n{text}"
    if tokenizer.eos_token_id is None:
        raise DataError("preference rows in plain mode append EOS to each response, but the tokenizer "
                        "has no eos token")
    prompt_ids = encode_text(tokenizer, text, special=True)
    for setting in responses:
        sides[setting] = _plain_side(prompt_ids, fields[setting], tokenizer, getattr(keys, setting), setting, where)
    return len(prompt_ids), sides


def preference_pair(row: dict, tokenizer, data: DataConfig, keys: PreferenceDataConfig, chat: bool,
                    where: str, index: int = 0) -> PreferencePair:
    """One row -> a :class:`PreferencePair` (see the module docstring); ``where`` names the row in errors."""
    prompt_len, sides = _encode_sides(row, tokenizer, data, keys, chat, where, ("chosen_key", "rejected_key"))
    (chosen_ids, chosen_mask), (rejected_ids, rejected_mask) = sides["chosen_key"], sides["rejected_key"]
    if chosen_ids == rejected_ids:
        raise DataError(f"{where}: fields {keys.chosen_key!r} and {keys.rejected_key!r} give the same tokens; "
                        f"a pair with identical responses carries no preference")
    return PreferencePair(index, prompt_len, chosen_ids, chosen_mask, rejected_ids, rejected_mask)


def unpaired_example(row: dict, tokenizer, data: DataConfig, keys: PreferenceDataConfig, chat: bool,
                     where: str, index: int = 0) -> UnpairedExample:
    """One unpaired row -> an :class:`UnpairedExample` without its KL row (the dataset builder adds it)."""
    label = _get(row, keys.label_key, "label_key", where)
    if not isinstance(label, bool):
        raise DataError(f"{where}: field {keys.label_key!r} (label_key) must be true (desirable) or false "
                        f"(undesirable), got {label!r}")
    prompt_len, sides = _encode_sides(row, tokenizer, data, keys, chat, where, ("completion_key",))
    ids, mask = sides["completion_key"]
    return UnpairedExample(index, prompt_len, ids, mask, label, [], [])


def _with_kl_rows(examples: list[UnpairedExample], limit: int, source: str, dropped: int) -> list[UnpairedExample]:
    """Each example with its KL row: its prompt + the completion of the nearest earlier example (cyclically)
    whose prompt differs, cut to ``limit``."""
    prompts = [tuple(e.ids[:e.prompt_len]) for e in examples]
    if len(set(prompts)) < 2:
        raise DataError(f"{source}: unpaired rows need at least two different prompts (the KL baseline pairs "
                        f"each prompt with another prompt's completion); {len(examples)} rows with "
                        f"{len(set(prompts))} prompts are left after dropping {dropped} longer than "
                        f"data.max_sequence_length={limit}")
    for i, example in enumerate(examples):
        other = next(examples[i - k] for k in range(1, len(examples)) if prompts[i - k] != prompts[i])
        ids = example.ids[:example.prompt_len] + other.ids[other.prompt_len:]
        mask = [0] * example.prompt_len + other.mask[other.prompt_len:]
        example.kl_ids, example.kl_mask = ids[:limit], mask[:limit]
    return examples


def build_preference_dataset(rows: list[dict], tokenizer, data: DataConfig, keys: PreferenceDataConfig | None = None,
                             source: str = "<rows>", locations: list[str] | None = None,
                             paired: bool = True) -> PreferenceDataset:
    """Tokenizes and length-filters ``rows`` (pairs, or unpaired rows when not ``paired``); ``locations``
    name each row in errors (default ``<source> row N``, 1-based)."""
    keys = PreferenceDataConfig() if keys is None else keys
    if data.messages_key is not None:
        raise DataError(f"data.messages_key is not read for preference pairs: a row's prompt "
                        f"({keys.prompt_key!r}) may itself be a list of chat messages; unset data.messages_key")
    if locations is None:
        locations = [f"{source} row {i + 1}" for i in range(len(rows))]
    chat = uses_chat_template(tokenizer, data)
    if not paired:
        examples = [unpaired_example(row, tokenizer, data, keys, chat, where, i)
                    for i, (row, where) in enumerate(zip(rows, locations, strict=True))]
        kept = [e for e in examples if len(e.ids) <= data.max_sequence_length]
        if len(kept) < len(examples):
            logger.warning("%s: dropped %d of %d unpaired rows longer than data.max_sequence_length=%d tokens",
                           source, len(examples) - len(kept), len(examples), data.max_sequence_length)
        dropped = len(examples) - len(kept)
        return PreferenceDataset(_with_kl_rows(kept, data.max_sequence_length, source, dropped), dropped, source)
    pairs = [preference_pair(row, tokenizer, data, keys, chat, where, i)
             for i, (row, where) in enumerate(zip(rows, locations, strict=True))]
    limit = data.max_sequence_length
    kept = [p for p in pairs if len(p.chosen_ids) <= limit and len(p.rejected_ids) <= limit]
    dropped = len(pairs) - len(kept)
    if dropped:
        logger.warning("%s: dropped %d of %d preference pairs with a side longer than data.max_sequence_length="
                       "%d tokens", source, dropped, len(pairs), limit)
    if not kept:
        raise DataError(f"{source}: no preference pair is left after filtering ({len(rows)} rows, "
                        f"data.max_sequence_length={limit})")
    return PreferenceDataset(kept, dropped, source)


def _row_locations(path: str, count: int) -> list[str] | None:
    """``file:line`` of each row of a JSONL file (``read_jsonl`` skips blank lines the same way)."""
    p = Path(path).expanduser()
    if not (p.is_file() and p.suffix.lower() in (".jsonl", ".json")):
        return None
    with open(p, encoding="utf-8") as f:
        lines = [number for number, line in enumerate(f, start=1) if line.strip()]
    return [f"{path}:{number}" for number in lines] if len(lines) == count else None


def load_preference_dataset(path: str, tokenizer, data: DataConfig, keys: PreferenceDataConfig | None = None,
                            paired: bool = True) -> PreferenceDataset:
    """The preference pairs (or unpaired rows) of a local JSONL / Parquet / ``save_to_disk`` source."""
    rows = read_records(path, data.split)
    return build_preference_dataset(rows, tokenizer, data, keys, source=str(path),
                                    locations=_row_locations(path, len(rows)), paired=paired)
