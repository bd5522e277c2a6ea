"""RL prompt datasets: rows -> rendered prompt text + token ids + ground truth, with length filtering.

A row gives its prompt as a string (``data.prompt_key``) or as chat messages (``data.messages_key``).
With a chat template (``data.chat_template``: ``auto`` uses the tokenizer's template when it has one,
``always`` requires it, ``never`` is plain completion) the prompt is rendered with the tokenizer's
``apply_chat_template(..., add_generation_prompt=True)``; in plain mode the prompt text is used as is
(after ``data.system_prompt`` and a blank line, if set). Prompts longer than
``data.max_prompt_length`` tokens are dropped, and the number dropped is logged and kept.

Dataset responses (``response_budget``: a distillation run that trains some steps on the data, GKD's
``lmbda < 1``): each row also gives the response to train on, as an SFT row does: its messages end with the
assistant's turn (which is then not part of the prompt), or it has a ``data.response_key`` field. The
response's tokens are rendered as SFT renders them (the assistant message with its end-of-turn tokens, or
the plain text and EOS), and the conversation's tokens must begin with the prompt's. Rows whose response is
longer than the budget (the run's ``rollout.response_budget``: what its sequences and memory are sized for) are
dropped like long prompts, and counted.

Tools. A multi-turn run describes its environment's tools in each prompt (``describe_tools``: the row's
metadata -> :class:`ToolDescription`). A chat template that renders tools gets them as
``apply_chat_template(..., tools=schemas)``, the way the model saw tools in its own post-training (Qwen2.5's
writes them into its system turn); a template that ignores ``tools=`` (SmolLM2's, the tiny models') gets
the description's text appended to the system message (one is added if the row has none); a plain
prompt gets that text and a blank line before the row's prompt (after ``data.system_prompt``). The
schemas are kept on the example (``tools``), so that
every later rendering of the conversation passes the same ``tools=``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from megarlhf.config.data import DataConfig
from megarlhf.data.chat import render_with_loss_mask, response_with_eos
from megarlhf.data.source import read_records
from megarlhf.core.errors import DataError

logger = logging.getLogger(__name__)


@dataclass
class PromptExample:
    index: int  # row number in the source file (0-based)
    prompt: str  # the text the model is given (template applied)
    prompt_ids: list[int]
    ground_truth: Any  # the row's answer field, None if absent
    metadata: dict[str, Any] = field(default_factory=dict)  # the row's other fields
    messages: list[dict[str, str]] | None = None  # chat mode: the messages the prompt renders (None: plain)
    tools: list[dict[str, Any]] | None = None  # the tool schemas described in the prompt (None: no tools)
    response_ids: list[int] | None = None  # the row's dataset response (module docstring), if asked for

    @property
    def episode_fields(self) -> dict[str, Any]:
        """What a multi-turn episode of this row is made from (:func:`episode_fields`)."""
        return episode_fields(self.ground_truth, self.metadata)


def episode_fields(ground_truth: Any, metadata: dict[str, Any]) -> dict[str, Any]:
    """A row's fields as an environment's factory gets them: its other fields and its answer as
    ``ground_truth`` (an environment that scores answers itself needs it; a row's own field of that name wins)."""
    return {"ground_truth": ground_truth, **metadata}


@dataclass(frozen=True)
class ToolDescription:
    """A row's tools: OpenAI-style function schemas (a template's ``tools=``) and the same tools as text
    for prompts whose template does not render them."""

    schemas: list[dict[str, Any]]
    text: str


ToolDescriber = Callable[[dict[str, Any]], ToolDescription]  # the row's metadata -> its tools
# what start-up checks render a template with, to see how it treats tools=
PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "a probe",
                                               "parameters": {"type": "object", "properties": {}}}}


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


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes ``tools=`` into the prompt (a probe rendered with and
    without a tool differs); a template that fails on ``tools=`` does not render them."""
    probe = [{"role": "user", "content": "probe"}]
    try:
        with_tools = tokenizer.apply_chat_template(probe, tools=[PROBE_TOOL], tokenize=False,
                                                   add_generation_prompt=True)
    except Exception:  # jinja's TemplateError or a template's own raise_exception: it has no tool support
        return False
    return with_tools != tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)


def with_tool_text(messages: list[dict[str, str]], text: str) -> list[dict[str, str]]:
    """``messages`` with ``text`` appended to the system message (inserted first when there is none)."""
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def render_prompt(row: dict, tokenizer, config: DataConfig, chat: bool, where: str,
                  tools: ToolDescription | None = None, template_tools: bool = False
                  ) -> tuple[str, list[dict[str, str]] | None]:
    """The prompt text of one row (chat template with a generation prompt, or plain text) and, in chat
    mode, the messages it renders. ``tools``: described as the module docstring says (``template_tools``:
    the template renders ``tools=``)."""
    if chat:
        messages = row_messages(row, config, where)
        if tools is not None and not template_tools:
            messages = with_tool_text(messages, tools.text)
        schemas = {"tools": tools.schemas} if tools is not None and template_tools else {}
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **schemas), messages
    if config.messages_key is not None:
        raise DataError(f"{where}: data.messages_key is set but prompts are plain text (data.chat_template="
                        f"{config.chat_template!r}, tokenizer template: "
                        f"{'yes' if getattr(tokenizer, 'chat_template', None) else 'none'})")
    text = text_field(row, config.prompt_key, "prompt_key", where)
    if tools is not None:
        text = f"{tools.text}\n\n{text}"
    return (text if config.system_prompt is None else f"{config.system_prompt}\n\n{text}"), None


def _row_tools(describe_tools: ToolDescriber, metadata: dict[str, Any], where: str) -> ToolDescription:
    try:
        return describe_tools(dict(metadata))
    except Exception as exc:  # the environment is user code: say which row it failed on
        raise DataError(f"{where}: the environment could not describe its tools: {type(exc).__name__}: {exc}") from exc


def _dataset_response(row: dict, tokenizer, config: DataConfig, chat: bool, where: str
                      ) -> tuple[dict, list[int], list[int] | None]:
    """(the row its prompt is rendered from, its response's ids, the prompt ids the conversation's rendering
    begins with (chat; None in plain mode)): module docstring."""
    if not chat:
        response = text_field(row, config.response_key, "response_key", where)
        return row, response_with_eos(tokenizer, response, where), None
    messages = row_messages(row, config, where)
    if config.messages_key is None:
        response = text_field(row, config.response_key, "response_key", where)
        messages.append({"role": "assistant", "content": response})
    elif messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: the conversation must end with the assistant's response (algorithm.distill.lmbda "
                        f"< 1 trains on it); its last message is the {messages[-1]['role']!r}'s")
    ids, mask = render_with_loss_mask(messages, tokenizer, len(messages) - 1, where)
    if 1 not in mask:
        raise DataError(f"{where}: the assistant's response renders to no tokens, so there is nothing to train on")
    start, end = mask.index(1), len(mask) - mask[::-1].index(1)
    prompt_row = {**row, config.messages_key: messages[:-1]} if config.messages_key is not None else row
    return prompt_row, ids[start:end], ids[:start]


def build_prompt_dataset(rows: list[dict], tokenizer, config: DataConfig, source: str = "<rows>",
                         describe_tools: ToolDescriber | None = None,
                         response_budget: int | None = None) -> PromptDataset:
    """Renders, tokenizes and length-filters ``rows`` (see the module docstring); with ``response_budget`` also
    their dataset responses of at most that many tokens."""
    chat = uses_chat_template(tokenizer, config)
    responses = [None] * len(rows)
    with_responses = response_budget is not None
    if with_responses:
        if describe_tools is not None:
            raise DataError(f"{source}: dataset responses (algorithm.distill.lmbda < 1) with tools are not supported")
        parts = [_dataset_response(row, tokenizer, config, chat, f"{source} row {i}") for i, row in enumerate(rows)]
        rows, responses = [p[0] for p in parts], parts
    template_tools = chat and describe_tools is not None and template_renders_tools(tokenizer)
    skip = {config.prompt_key, config.answer_key, config.messages_key}
    metadata = [{k: v for k, v in row.items() if k not in skip} for row in rows]
    tools = [None if describe_tools is None else
             _row_tools(describe_tools, episode_fields(row.get(config.answer_key), fields), f"{source} row {i}")
             for i, (row, fields) in enumerate(zip(rows, metadata))]
    rendered = [render_prompt(row, tokenizer, config, chat, f"{source} row {i}", tools[i], template_tools)
                for i, row in enumerate(rows)]
    # a chat template writes its own special tokens; plain text gets the tokenizer's usual ones (BOS)
    ids = tokenizer([text for text, _ in rendered], add_special_tokens=not chat)["input_ids"] if rendered else []
    if with_responses:
        _check_response_prefixes(ids, responses, source)
    long_responses = {i for i, r in enumerate(responses) if r is not None and len(r[1]) > response_budget}
    if long_responses:
        logger.warning("%s: dropped %d of %d rows whose dataset response is longer than the response budget of %d "
                       "tokens (rows %s...)", source, len(long_responses), len(rows), response_budget,
                       sorted(long_responses)[:5])
    examples = [PromptExample(i, text, list(tokens), row.get(config.answer_key), metadata[i], messages,
                              None if tools[i] is None else tools[i].schemas,
                              None if responses[i] is None else responses[i][1])
                for i, (row, (text, messages), tokens) in enumerate(zip(rows, rendered, ids))
                if len(tokens) <= config.max_prompt_length and i not in long_responses]
    dropped = len(rows) - len(examples) - len(long_responses)
    if dropped:
        logger.warning("%s: dropped %d of %d prompts longer than data.max_prompt_length=%d tokens",
                       source, dropped, len(rows), config.max_prompt_length)
    dropped += len(long_responses)
    if not examples:
        raise DataError(f"{source}: no prompt is left after filtering ({len(rows)} rows, "
                        f"data.max_prompt_length={config.max_prompt_length})")
    # rows without answers are fine for rewards that need none; a run whose rewards need them is refused
    # by megarlhf.run.checks.check_ground_truths, naming data.answer_key
    return PromptDataset(examples, dropped, source)


def _check_response_prefixes(prompt_ids: list[list[int]], responses: list[tuple], source: str) -> None:
    """Each conversation's rendering must begin with its prompt's tokens, or the dataset response would not
    continue the prompt the model reads."""
    for i, (tokens, (_, _, begins)) in enumerate(zip(prompt_ids, responses)):
        if begins is not None and list(tokens) != list(begins):
            raise DataError(f"{source} row {i}: the conversation's tokens do not begin with its prompt's (the chat "
                            f"template or the tokenizer joins the prompt and the response differently), so its "
                            f"response cannot be trained on as a continuation of the prompt")


def load_prompt_dataset(path: str, tokenizer, config: DataConfig, describe_tools: ToolDescriber | None = None,
                        response_budget: int | None = None) -> PromptDataset:
    """The prompts of a local JSONL / Parquet / ``save_to_disk`` source (and their dataset responses)."""
    return build_prompt_dataset(read_records(path, config.split), tokenizer, config, str(path), describe_tools,
                                response_budget)
