"""The lookup tool: case-insensitive hits, misses as observations, tables from a dict, JSON and JSONL files
(with errors naming the file and line), the per-file cache, and the environment's kwargs."""
from __future__ import annotations

import json
import os

import pytest

from megarlhf.envs import ENVIRONMENTS, LookupTable, ParsedCall, StepResult, ToolError

CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Côte d'Ivoire": "Yamoussoukro", "Answer": 42,
            "Coordinates": {"lat": 48.85, "lon": 2.35}}


def test_hits_and_misses():
    table = LookupTable(CAPITALS)
    assert len(table) == 5
    assert table.lookup("France") == "Paris"
    assert table.lookup("  fRANCE ") == "Paris"
    assert table.lookup("CÔTE D'IVOIRE") == "Yamoussoukro"
    assert table.lookup("answer") == "42"  # non-strings are shown as JSON
    assert table.lookup("coordinates") == '{"lat": 48.85, "lon": 2.35}'
    assert table.lookup(" Italy ") == "not found: no entry for 'Italy'"
    assert table.lookup("Fran") == "not found: no entry for 'Fran'"  # whole keys only
    with pytest.raises(ToolError, match="^the key is empty$"):
        table.lookup("  ")
    with pytest.raises(ToolError, match="^the key must be a string, got int$"):
        table.lookup(3)


def test_bad_tables():
    with pytest.raises(ValueError, match="keys 'Paris' and 'PARIS ' are the same key"):
        LookupTable({"Paris": 1, "PARIS ": 2})
    with pytest.raises(ValueError, match="keys must be non-empty strings, got 3"):
        LookupTable({3: "x"})
    with pytest.raises(ValueError, match="must be a mapping of keys to values, got list"):
        LookupTable([("a", 1)])


def test_json_and_jsonl_files(tmp_path):
    as_json = tmp_path / "capitals.json"
    as_json.write_text(json.dumps(CAPITALS), encoding="utf-8")
    as_jsonl = tmp_path / "capitals.jsonl"
    as_jsonl.write_text("".join(json.dumps({"country": k, "capital": v}) + "\n" for k, v in CAPITALS.items())
                        + "\n", encoding="utf-8")
    for table in (LookupTable.from_file(as_json), LookupTable.from_file(as_jsonl, "country", "capital")):
        assert table.lookup("japan") == "Tokyo" and table.lookup("answer") == "42"
        assert table.lookup("Peru") == "not found: no entry for 'Peru'"


@pytest.mark.parametrize("name, text, message", [
    ("t.jsonl", '{"key": "a", "value": 1}\n{"key": "b", "value": \n', r"t.jsonl:2: not valid JSON"),
    ("t.jsonl", '{"key": "a", "value": 1}\n{"key": "b"}\n', r"t.jsonl:2: expected an object with fields 'key' and 'value'"),
    ("t.jsonl", '{"key": "a", "value": 1}\n\n{"key": "a", "value": 2}\n', r"t.jsonl:3: key 'a' appears twice"),
    ("t.json", '{"a": 1,}', r"t.json: not valid JSON"),
    ("t.json", '["a", 1]', r"t.json must be a mapping of keys to values, got list"),
    ("t.csv", "a,1\n", r"t.csv' must end in .json or .jsonl"),
])
def test_bad_files_name_file_and_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        LookupTable.from_file(path)


def test_file_is_parsed_once_per_version(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"a": "first"}', encoding="utf-8")
    first = LookupTable.from_file(path)
    assert LookupTable.from_file(str(path)) is first
    path.write_text('{"a": "second"}', encoding="utf-8")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a newer version, whatever the clock
    assert LookupTable.from_file(path).lookup("A") == "second"
    with pytest.raises(ValueError, match="does not exist"):
        LookupTable.from_file(tmp_path / "missing.json")


def test_lookup_environment(tmp_path):
    make = ENVIRONMENTS.get("lookup")
    episode = make({"question": "ignored"}, table=CAPITALS)
    assert [spec.name for spec in episode.tools] == ["lookup"] and episode.tools[0].required == ["key"]
    assert episode.step([], ParsedCall("lookup", {"key": "france"})) == StepResult("Paris")
    assert episode.step([], ParsedCall("lookup", {"key": "Mars"})) == StepResult("not found: no entry for 'Mars'")
    assert episode.step([], ParsedCall("lookup", {"key": ""})) == StepResult("error: the key is empty",
                                                                             info={"tool_error": "the key is empty"})
    path = tmp_path / "t.jsonl"
    path.write_text('{"k": "x", "v": "y"}\n', encoding="utf-8")
    assert make({}, path=str(path), key_field="k", value_field="v").step([], ParsedCall("lookup", {"key": "X"})) \
        == StepResult("y")
    for kwargs in ({}, {"table": CAPITALS, "path": str(path)}):
        with pytest.raises(ValueError, match="needs exactly one of kwargs 'table'"):
            make({}, **kwargs)
