"""The built-in ``lookup`` tool: a key -> text table the model can query (a dict given in the env kwargs,
or a JSON / JSONL file), matched case-insensitively; a missing key is an observation, not an error.

Files: ``.json`` holds one object ``{"key": value, ...}``; ``.jsonl`` holds one record per line,
``{"key": ..., "value": ...}`` (the field names are kwargs). Values that are not strings are shown as
JSON. Keys that differ only in case collide and are refused when the table is built. A file is parsed once
per (path, modification time) and shared by every episode.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Mapping

from megarlhf.envs.api import ENVIRONMENTS, ToolEpisode, ToolError, ToolSpec, stateless
from megarlhf.core.errors import ConfigError, DataError


def _normalize(key: str) -> str:
    return key.strip().casefold()


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class LookupTable:
    """Case-insensitive lookups in a fixed table; :meth:`lookup` is the tool."""

    def __init__(self, entries: Mapping[str, Any], source: str = "the lookup table"):
        if not isinstance(entries, Mapping):
            raise DataError(f"{source} must be a mapping of keys to values, got {type(entries).__name__}")
        self._entries: dict[str, tuple[str, str]] = {}
        for key, value in entries.items():
            if not isinstance(key, str) or not key.strip():
                raise DataError(f"{source}: keys must be non-empty strings, got {key!r}")
            normalized = _normalize(key)
            if normalized in self._entries:
                raise DataError(f"{source}: keys {self._entries[normalized][0]!r} and {key!r} are the same "
                                f"key (lookups ignore case and surrounding spaces)")
            self._entries[normalized] = (key, _as_text(value))

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: Any) -> str:
        if not isinstance(key, str):
            raise ToolError(f"the key must be a string, got {type(key).__name__}")
        if not key.strip():
            raise ToolError("the key is empty")
        hit = self._entries.get(_normalize(key))
        return hit[1] if hit is not None else f"not found: no entry for {key.strip()!r}"

    @classmethod
    def from_file(cls, path: str | Path, key_field: str = "key", value_field: str = "value") -> "LookupTable":
        """A table from ``path`` (parsed once per path and modification time)."""
        file = Path(path).expanduser().resolve()
        if not file.is_file():
            raise DataError(f"lookup table file {str(path)!r} does not exist")
        return _load(str(file), file.stat().st_mtime_ns, key_field, value_field)


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime_ns: int, key_field: str, value_field: str) -> LookupTable:
    text = Path(path).read_text(encoding="utf-8")
    if path.endswith(".jsonl"):
        entries: dict[str, Any] = {}
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{number}: not valid JSON: {exc.msg}") from None
            if not isinstance(record, dict) or key_field not in record or value_field not in record:
                raise DataError(f"{path}:{number}: expected an object with fields {key_field!r} and "
                                f"{value_field!r}, got {line.strip()[:80]!r}")
            if record[key_field] in entries:
                raise DataError(f"{path}:{number}: key {record[key_field]!r} appears twice")
            entries[record[key_field]] = record[value_field]
        return LookupTable(entries, source=path)
    if path.endswith(".json"):
        try:
            entries = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: not valid JSON: {exc.msg} (line {exc.lineno})") from None
        return LookupTable(entries, source=path)
    raise DataError(f"lookup table file {path!r} must end in .json or .jsonl")


LOOKUP_TOOL = ToolSpec(
    name="lookup",
    description="Looks a key up in a reference table and returns its entry (case-insensitive), "
                "or 'not found: ...' when the table has no such key.",
    parameters={"type": "object", "required": ["key"],
                "properties": {"key": {"type": "string", "description": "the key to look up"}}},
)


@ENVIRONMENTS.register("lookup")
@stateless
def lookup_env(metadata: dict, table: Mapping[str, Any] | None = None, path: str | None = None,
               key_field: str = "key", value_field: str = "value") -> ToolEpisode:
    """A stateless episode with one tool, ``lookup(key)``, over ``table`` (a dict) or the file ``path``."""
    if (table is None) == (path is None):
        raise ConfigError("the lookup environment needs exactly one of kwargs 'table' (a mapping) or "
                          f"'path' (a .json/.jsonl file), got table={'set' if table is not None else None}, "
                          f"path={path!r}")
    lookup_table = LookupTable(table) if table is not None else LookupTable.from_file(path, key_field, value_field)
    return ToolEpisode([LOOKUP_TOOL], {"lookup": lookup_table.lookup})
