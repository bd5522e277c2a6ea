"""Tool-call parsers: exact ParsedCall / ParseError contents on well-formed and malformed turns, and the
format picked from a tokenizer's own tool-call tokens (tokenizers built here, with and without them)."""
from __future__ import annotations

import json

import pytest

from megarlhf.envs import PARSERS, ParsedCall, ParseError, ToolSpec, detect_format
from megarlhf.envs.parsers import HERMES, MISTRAL
from model_providers.tiny_models import train_tiny_tokenizer

ADD = ToolSpec("add", "adds two numbers", {"type": "object", "required": ["a", "b"],
                                           "properties": {"a": {"type": "number"}, "b": {"type": "number"}}})
NOW = ToolSpec("now", "the current time")  # no arguments
ANY = ToolSpec("note", "free-form", {"type": "object"})  # any arguments
TOOLS = [ADD, NOW, ANY]


@pytest.fixture(scope="module")
def hermes():
    return PARSERS.get("hermes")(TOOLS)


@pytest.fixture(scope="module")
def mistral():
    return PARSERS.get("mistral")(TOOLS)


@pytest.mark.parametrize("text, want", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', ParsedCall("add", {"a": 1, "b": 2})),
    ('Let me add.\n<tool_call>{"name": "add", "arguments": {"b": 2.5, "a": -1}}</tool_call>\nDone.',
     ParsedCall("add", {"a": -1, "b": 2.5})),
    # what Qwen2.5's template renders, the end of turn kept when special tokens are not skipped
    ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>', ParsedCall("now", {})),
    ('<tool_call>{"name": "note", "arguments": {"text": "caf\\u00e9 \u2615", "tags": ["a", {"b": null}]}}</tool_call>',
     ParsedCall("note", {"text": "café ☕", "tags": ["a", {"b": None}]})),
    ('<tool_call>{"arguments": {"a": 0, "b": 0}, "name": "add", "id": "x1"}</tool_call>', ParsedCall("add", {"a": 0, "b": 0})),
])
def test_hermes_well_formed(hermes, text, want):
    assert hermes(text) == want


@pytest.mark.parametrize("text", ["The answer is 4.", "", "I could write a tool_call here, or <tool call>."])
def test_no_call_is_none(hermes, mistral, text):
    assert hermes(text) is None
    assert mistral(text) is None


def _json_error(payload: str) -> str:
    try:
        json.loads(payload)
    except json.JSONDecodeError as exc:
        return f"{exc.msg} at character {exc.pos}"
    raise AssertionError(f"{payload!r} is valid JSON")


def test_hermes_bad_json(hermes):
    payload = '{"name": "add", "arguments": {"a": 1,}}'
    # independent of the parser: where json itself stops, and the hand-counted column of the stray brace
    assert _json_error(payload) == "Expecting property name enclosed in double quotes at character 37"
    assert hermes(f"<tool_call>\n{payload}\n</tool_call>") == ParseError(
        f"the tool call is not valid JSON (Expecting property name enclosed in double quotes at character 37): "
        f"{payload!r}")
    long = '{"name": "add", "arguments": ' + "[1, " * 60 + "}"
    message = hermes(f"<tool_call>{long}</tool_call>").message
    assert message.endswith(repr(long[:80] + "...")) and message.startswith("the tool call is not valid JSON (")


@pytest.mark.parametrize("payload, message", [
    ('{"name": "mul", "arguments": {"a": 1}}', "unknown tool 'mul'; available tools: add, note, now"),
    ('{"name": "add"}', 'the call of \'add\' has no "arguments" object'),
    ('{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}', 'the "arguments" of \'add\' must be a JSON object, got str'),
    ('{"name": "add", "arguments": {"a": 1}}', "the call of 'add' lacks required argument(s): b"),
    ('{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3, "d": 4}}',
     "unexpected argument(s) for 'add': c, d; it takes: a, b"),
    ('{"name": "now", "arguments": {"tz": "UTC"}}', "unexpected argument(s) for 'now': tz; it takes: no arguments"),
    ('{"arguments": {}}', 'the tool call has no "name" string (keys: arguments)'),
    ('{"name": 3, "arguments": {}}', 'the tool call has no "name" string (keys: name, arguments)'),
    ('[{"name": "now", "arguments": {}}]', 'a tool call must be a JSON object {"name": ..., "arguments": {...}}, got list'),
])
def test_hermes_malformed_call(hermes, payload, message):
    assert hermes(f"<tool_call>{payload}</tool_call>") == ParseError(message)


@pytest.mark.parametrize("text, message", [
    ('<tool_call>{"name": "now", "arguments": {}}</tool_call> and <tool_call>{"name": "now", "arguments": {}}</tool_call>',
     "found 2 tool calls in one turn; call one tool per turn"),
    ('<tool_call>{"name": "now", "arguments": {}}', "the tool call is not closed: <tool_call> needs a matching </tool_call>"),
    ('{"name": "now", "arguments": {}}</tool_call>', "found </tool_call> without a <tool_call> before it"),
])
def test_hermes_malformed_structure(hermes, text, message):
    assert hermes(text) == ParseError(message)


def test_mistral_formats(mistral):
    assert mistral('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]</s>') == ParsedCall("add", {"a": 1, "b": 2})
    assert mistral('[TOOL_CALLS]add[ARGS]{"a": 3, "b": 4}') == ParsedCall("add", {"a": 3, "b": 4})
    two = '[TOOL_CALLS][{"name": "now", "arguments": {}}, {"name": "now", "arguments": {}}]'
    assert mistral(two) == ParseError("found 2 tool calls in one turn; call one tool per turn")
    assert mistral('[TOOL_CALLS]{"name": "now", "arguments": {}}') == ParseError(
        "[TOOL_CALLS] must be followed by a JSON list of calls, got '{\"name\": \"now\", \"arguments\": {}}'")
    assert mistral('[TOOL_CALLS]mul[ARGS]{"a": 1}') == ParseError("unknown tool 'mul'; available tools: add, note, now")
    assert mistral("[TOOL_CALLS]add[ARGS]{'a': 1}").message.startswith("the arguments of the tool call are not valid JSON")
    assert mistral("[TOOL_CALLS][] [TOOL_CALLS][]") == ParseError("found 2 tool calls in one turn; call one tool per turn")


@pytest.mark.parametrize("name", ["hermes", "mistral"])
def test_format_call_round_trips_and_instructions(name):
    parser = PARSERS.get(name)(TOOLS)
    for call in (ParsedCall("add", {"a": 1, "b": -2.5}), ParsedCall("now", {}), ParsedCall("note", {"x": [1, "é"]})):
        assert parser(parser.format_call(call)) == call
    text = parser.instructions()
    for spec in TOOLS:
        assert json.dumps(spec.schema()) in text
    assert parser.format.start in text


def test_parsers_registry_and_duplicate_tools():
    assert PARSERS.names() == ["hermes", "mistral", "tokenizer"]
    with pytest.raises(KeyError, match="unknown tool-call parser 'xml'; known: hermes, mistral, tokenizer"):
        PARSERS.get("xml")
    with pytest.raises(ValueError, match="tool names must be unique"):
        PARSERS.get("hermes")([ADD, ADD])


@pytest.fixture(scope="module")
def base_tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_tiny_tokenizer().save_pretrained(out)
    return out


def _tokenizer(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def test_tokenizer_without_tool_tokens_falls_back_to_hermes(base_tokenizer_dir):
    tokenizer = _tokenizer(base_tokenizer_dir)  # the tiny models' ChatML template, like SmolLM2's
    assert detect_format(tokenizer) is HERMES
    parser = PARSERS.get("tokenizer")(TOOLS, tokenizer)
    assert parser.format is HERMES and parser.stop_token_ids == () and not parser.needs_special_tokens
    assert parser('<tool_call>{"name": "now", "arguments": {}}</tool_call>') == ParsedCall("now", {})
    assert PARSERS.get("tokenizer")(TOOLS).format is HERMES  # no tokenizer at all


def test_tokenizer_with_hermes_tokens(base_tokenizer_dir):
    tokenizer = _tokenizer(base_tokenizer_dir)
    assert tokenizer.add_tokens(["<tool_call>", "</tool_call>"]) == 2  # added, not special: as in Qwen2.5
    start, end = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    parser = PARSERS.get("tokenizer")(TOOLS, tokenizer)
    assert parser.format is HERMES and parser.stop_token_ids == (end,) and not parser.needs_special_tokens
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == start and ids[-1] == end  # each marker is one token
    assert parser(tokenizer.decode(ids, skip_special_tokens=True)) == ParsedCall("add", {"a": 1, "b": 2})


def test_tokenizer_with_mistral_special_token(base_tokenizer_dir):
    tokenizer = _tokenizer(base_tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    parser = PARSERS.get("tokenizer")(TOOLS, tokenizer)
    assert detect_format(tokenizer) is MISTRAL
    assert parser.format is MISTRAL and parser.needs_special_tokens and parser.stop_token_ids == ()
    ids = tokenizer.encode('[TOOL_CALLS][{"name": "now", "arguments": {}}]', add_special_tokens=False)
    assert parser(tokenizer.decode(ids, skip_special_tokens=False)) == ParsedCall("now", {})
    assert parser(tokenizer.decode(ids, skip_special_tokens=True)) is None  # why needs_special_tokens matters


def test_tokenizer_format_from_chat_template_text(base_tokenizer_dir):
    tokenizer = _tokenizer(base_tokenizer_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}[TOOL_CALLS]"
    assert detect_format(tokenizer) is MISTRAL
    tokenizer.chat_template = {"default": "{{ messages }}", "tool_use": "<tool_call>{{ tools }}</tool_call>"}
    assert detect_format(tokenizer) is HERMES


def test_tokenizer_parser_rejects_non_tokenizers():
    with pytest.raises(ValueError, match="tokenizer dict has no added_tokens_decoder"):
        PARSERS.get("tokenizer")(TOOLS, {})


@pytest.mark.parametrize("payload, message", [
    ('{"name": "note", "arguments": {"x": ' + "[" * 5000 + "]" * 5000 + "}}", "nested too deeply"),
    ('{"name": "add", "arguments": {"a": ' + "7" * 5000 + ', "b": 1}}', "4300 digits"),
])
def test_hostile_json_is_a_parse_error_not_a_crash(hermes, mistral, payload, message):
    """Model output is hostile input: JSON nested thousands deep (RecursionError in json) or an integer
    literal past Python's 4300-digit conversion limit (ValueError) is a parse error shown to the model."""
    for parser, text in ((hermes, f"<tool_call>{payload}</tool_call>"), (mistral, f"[TOOL_CALLS][{payload}]")):
        result = parser(text)
        assert isinstance(result, ParseError) and message in result.message, result
