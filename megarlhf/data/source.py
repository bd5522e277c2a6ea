"""Where the data comes from: the data settings and the readers for JSONL, Parquet and ``datasets`` dirs.

:func:`read_records` returns a dataset's rows as a list of dicts. Supported sources, all local:

* a ``.jsonl`` / ``.json`` file with one JSON object per line (a malformed line is reported with the file
  and line number);
* a ``.parquet`` file (read with pyarrow);
* a directory written by ``datasets.Dataset.save_to_disk`` (read with ``datasets.load_from_disk``; a
  ``DatasetDict`` directory needs ``split``).

The Hugging Face hub is never contacted: a path that does not exist is an error, and one that looks
like a hub name (``owner/name``) says so. A bad JSONL row is reported
with its line number, which ``datasets``' JSON builder does not do.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megarlhf.core.errors import DataError
from megarlhf.core.hub import looks_like_hub_name


def _missing_path_error(path: str) -> FileNotFoundError:
    if looks_like_hub_name(path):
        return FileNotFoundError(f"data path {path!r} does not exist; it looks like a Hugging Face hub name, "
                                 f"but megarlhf reads local files only (no hub access): download the "
                                 f"dataset and save it as JSONL, Parquet or a save_to_disk directory")
    return FileNotFoundError(f"data path {path!r} does not exist")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{number}: malformed JSON line ({exc.msg} at column {exc.colno})") from None
            except RecursionError:
                raise DataError(f"{path}:{number}: the JSON line is nested too deeply to decode") from None
            except ValueError as exc:  # e.g. an integer literal past sys.get_int_max_str_digits() (4300 digits)
                raise DataError(f"{path}:{number}: the JSON line cannot be decoded: {exc}") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def read_records(path: str, split: str | None = None) -> list[dict[str, Any]]:
    """The rows of a local JSONL / Parquet file or ``save_to_disk`` directory, as dicts."""
    p = Path(path).expanduser()
    if not p.exists():
        raise _missing_path_error(str(path))
    if p.is_dir():
        return _read_dataset_dir(p, split)
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return read_jsonl(p)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    raise DataError(f"data file {str(p)!r}: unsupported extension {suffix!r}; use .jsonl, .parquet "
                    f"or a datasets save_to_disk directory")


def _read_dataset_dir(path: Path, split: str | None) -> list[dict[str, Any]]:
    import datasets

    try:
        data = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise DataError(f"data directory {str(path)!r} is not a datasets save_to_disk directory: {exc}") from None
    if isinstance(data, datasets.DatasetDict):
        if split is None or split not in data:
            raise DataError(f"data directory {str(path)!r} holds splits {sorted(data)}; set data.split "
                            f"to one of them (got {split!r})")
        data = data[split]
    return data.to_list()
