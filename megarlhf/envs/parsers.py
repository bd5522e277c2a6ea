"""Tool-call parsers: find the one tool call in a model turn and check it against the episode's tools.

Every entry of :data:`PARSERS` has one signature, a factory bound to the episode's tools::

    make_parser(tools: Sequence[ToolSpec], tokenizer=None) -> ToolCallParser
    parser(text: str) -> ParsedCall | None | ParseError     # None: the turn calls no tool
    parser.stop_token_ids, parser.special_marker_ids        # token ids: where a turn may stop; what it keeps

A malformed call (bad JSON, unknown tool, missing or unexpected arguments, a second call in the same turn,
an unclosed tag) is a :class:`ParseError` whose message is meant for the model; parsing never raises.
One call per turn: the rollout loop runs one tool and shows one observation before the next turn.

Formats (``CallFormat``):

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Qwen2.5's chat template
  teaches exactly this (system prompt ``<tools></tools>``, calls rendered as ``<tool_call>\\n{json}\\n
  </tool_call>``, results as a user turn wrapped in ``<tool_response>``), and its tokenizer has
  ``<tool_call>`` / ``</tool_call>`` as single added tokens (ids 151657/151658, *not* special, so they
  survive ``skip_special_tokens``). Qwen3, Hermes 2/3 and SmolLM3 use it too. SmolLM2-135M-Instruct's
  template is plain ChatML with no tool support and its tokenizer has no tool tokens: it (like the tiny
  test models) gets this format as text, taught by :meth:`ToolCallParser.instructions`.
* ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list ``[{"name": ..., "arguments": {...}}]`` (v0.3
  tokenizers) or by ``name[ARGS]{...}`` (tokenizers that have an ``[ARGS]`` token). ``[TOOL_CALLS]`` is a
  *special* token there: decode with ``skip_special_tokens=False`` (see ``needs_special_tokens``).

The ``tokenizer`` entry picks the format from the tokenizer: a format whose start marker is one of the
tokenizer's added tokens, else one whose marker its chat template mentions, else ``hermes``. vLLM's tool
parsers are tied to its OpenAI server's request types and do not check calls against the episode's tools.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from megarlhf.envs.tool_calls import ParsedCall, ParseError, ToolSpec
from megarlhf.core.registry import Registry


@dataclass(frozen=True)
class CallFormat:
    """A tool-call convention: the text that starts a call and the text that ends it (None: end of turn)."""

    name: str
    start: str
    end: str | None


HERMES = CallFormat("hermes", "<tool_call>", "</tool_call>")
MISTRAL = CallFormat("mistral", "[TOOL_CALLS]", None)
FORMATS = (HERMES, MISTRAL)  # the order in which the tokenizer parser looks for them
_MISTRAL_ARGS = "[ARGS]"
_SHOWN = 80  # characters of a bad payload quoted back to the model


def _quote(text: str) -> str:
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")


def _decode_json(text: str, what: str, whole: bool = True) -> Any:
    """The JSON value ``text`` holds (``whole=False``: the one it starts with, anything after it ignored),
    or a ParseError saying why not, whose subject is ``what`` ("the tool call is"). Model output is
    hostile: besides malformed JSON, nesting thousands deep (``RecursionError`` in the decoder) and
    integers past Python's digit limit (``ValueError``) are reported, never raised."""
    try:
        return json.loads(text) if whole else json.JSONDecoder().raw_decode(text)[0]
    except json.JSONDecodeError as exc:
        return ParseError(f"{what} not valid JSON ({exc.msg} at character {exc.pos}): {_quote(text)}")
    except RecursionError:
        return ParseError(f"{what} nested too deeply to decode: {_quote(text)}")
    except ValueError as exc:  # e.g. an integer literal past sys.get_int_max_str_digits() (4300 digits)
        return ParseError(f"{what} not decodable ({exc}): {_quote(text)}")


class ToolCallParser:
    """Parses one format against a fixed set of tools; ``__call__`` is the parse signature above.

    ``stop_token_ids``: the end marker's token id when the tokenizer has it as one token (a rollout may
    stop the turn there). ``special_marker_ids``: the markers that are special tokens (then
    ``needs_special_tokens``): a turn must be decoded with them kept or the parser never sees them."""

    def __init__(self, tools: Sequence[ToolSpec], fmt: CallFormat = HERMES, tokenizer: Any = None):
        self.tools = {spec.name: spec for spec in tools}
        if len(self.tools) != len(tools):
            raise ValueError(f"tool names must be unique, got {[spec.name for spec in tools]}")
        self.format = fmt
        added = added_tokens(tokenizer)
        markers = [m for m in (fmt.start, fmt.end) if m is not None] + ([_MISTRAL_ARGS] if fmt is MISTRAL else [])
        self.stop_token_ids: tuple[int, ...] = ((added[fmt.end][0],) if fmt.end in added else ())
        self.special_marker_ids = tuple(added[m][0] for m in markers if m in added and added[m][1])
        self.needs_special_tokens = bool(self.special_marker_ids)

    def __call__(self, text: str) -> ParsedCall | None | ParseError:
        fmt = self.format
        count = text.count(fmt.start)
        if count == 0:
            if fmt.end is not None and fmt.end in text:
                return ParseError(f"found {fmt.end} without a {fmt.start} before it")
            return None
        if count > 1:
            return ParseError(f"found {count} tool calls in one turn; call one tool per turn")
        after = text[text.index(fmt.start) + len(fmt.start):]
        if fmt is MISTRAL:
            return self._parse_mistral(after)
        if fmt.end not in after:
            return ParseError(f"the tool call is not closed: {fmt.start} needs a matching {fmt.end}")
        value = _decode_json(after[:after.index(fmt.end)].strip(), "the tool call is")
        return value if isinstance(value, ParseError) else self._check(value)

    def _parse_mistral(self, after: str) -> ParsedCall | ParseError:
        body = after.lstrip()
        if _MISTRAL_ARGS in body and not body.startswith("["):  # name[ARGS]{...}
            name, _, args = body.partition(_MISTRAL_ARGS)
            arguments = _decode_json(args.lstrip(), "the arguments of the tool call are", whole=False)
            if isinstance(arguments, ParseError):
                return arguments
            return self._check({"name": name.strip(), "arguments": arguments})
        value = _decode_json(body, "the tool call is", whole=False)  # text after the list (an EOS token) is ignored
        if isinstance(value, ParseError):
            return value
        if not isinstance(value, list):
            return ParseError(f"{MISTRAL.start} must be followed by a JSON list of calls, got {_quote(body)}")
        if len(value) != 1:
            return ParseError(f"found {len(value)} tool calls in one turn; call one tool per turn")
        return self._check(value[0])

    def _check(self, value: Any) -> ParsedCall | ParseError:
        """``value`` (decoded JSON) as a call of one of the tools, or what is wrong with it."""
        if not isinstance(value, dict):
            return ParseError(f'a tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, '
                              f"got {type(value).__name__}")
        name = value.get("name")
        if not isinstance(name, str):
            return ParseError(f'the tool call has no "name" string (keys: {", ".join(map(str, value)) or "none"})')
        spec = self.tools.get(name)
        if spec is None:
            return ParseError(f"unknown tool {name!r}; available tools: {', '.join(sorted(self.tools))}")
        if "arguments" not in value:
            return ParseError(f'the call of {name!r} has no "arguments" object')
        arguments = value["arguments"]
        if not isinstance(arguments, dict):
            return ParseError(f'the "arguments" of {name!r} must be a JSON object, got {type(arguments).__name__}')
        missing = [a for a in spec.required if a not in arguments]
        if missing:
            return ParseError(f"the call of {name!r} lacks required argument(s): {', '.join(missing)}")
        if "properties" in spec.parameters:  # a schema without "properties" accepts any arguments
            unexpected = [a for a in arguments if a not in spec.properties]
            if unexpected:
                return ParseError(f"unexpected argument(s) for {name!r}: {', '.join(unexpected)}; "
                                  f"it takes: {', '.join(spec.properties) or 'no arguments'}")
        return ParsedCall(name, arguments)

    def format_call(self, call: ParsedCall) -> str:
        """``call`` written in this parser's format (what a model should emit; parsing it gives ``call``)."""
        payload = {"name": call.name, "arguments": call.arguments}
        if self.format is MISTRAL:
            return f"{MISTRAL.start}{json.dumps([payload])}"
        return f"{self.format.start}\n{json.dumps(payload)}\n{self.format.end}"

    def instructions(self) -> str:
        """A system-prompt paragraph describing the tools and this format, for chat templates that have
        no tool support of their own (they ignore ``tools=``: SmolLM2's, the tiny models')."""
        lines = [json.dumps(spec.schema()) for spec in self.tools.values()]
        example = self.format_call(ParsedCall("<tool name>", {"<argument>": "<value>"}))
        return ("You can call the following tools, described as JSON schemas:\n" + "\n".join(lines)
                + f"\nTo call a tool, write exactly one call in this form and stop:\n{example}\n"
                + "The result comes back in the next message.")


def added_tokens(tokenizer: Any) -> dict[str, tuple[int, bool]]:
    """The tokenizer's added tokens: content -> (id, special). Empty without a tokenizer."""
    if tokenizer is None:
        return {}
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if decoder is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no added_tokens_decoder; "
                         f"pass a transformers tokenizer")
    return {str(token): (int(i), bool(getattr(token, "special", False))) for i, token in decoder.items()}


def _chat_templates(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else str(template)


def detect_format(tokenizer: Any) -> CallFormat:
    """The tool-call format a tokenizer carries: by its added tokens, then by its chat template's text,
    else ``hermes`` (which needs no special tokens)."""
    added = added_tokens(tokenizer)
    for fmt in FORMATS:
        if fmt.start in added and (fmt.end is None or fmt.end in added):
            return fmt
    template = _chat_templates(tokenizer)
    for fmt in FORMATS:
        if fmt.start in template:
            return fmt
    return HERMES


ParserFactory = Callable[..., ToolCallParser]  # make_parser(tools, tokenizer=None) -> ToolCallParser
PARSERS: Registry[ParserFactory] = Registry("tool-call parser")


@PARSERS.register("hermes")
def hermes_parser(tools: Sequence[ToolSpec], tokenizer: Any = None) -> ToolCallParser:
    """``<tool_call>{json}</tool_call>`` whatever the tokenizer (its token ids are used if it has them)."""
    return ToolCallParser(tools, HERMES, tokenizer)


@PARSERS.register("mistral")
def mistral_parser(tools: Sequence[ToolSpec], tokenizer: Any = None) -> ToolCallParser:
    """``[TOOL_CALLS][{json}]`` or ``[TOOL_CALLS]name[ARGS]{json}``."""
    return ToolCallParser(tools, MISTRAL, tokenizer)


@PARSERS.register("tokenizer")
def tokenizer_parser(tools: Sequence[ToolSpec], tokenizer: Any = None) -> ToolCallParser:
    """The format of the tokenizer's own tool-call tokens (:func:`detect_format`); ``hermes`` without one."""
    return ToolCallParser(tools, detect_format(tokenizer) if tokenizer is not None else HERMES, tokenizer)
